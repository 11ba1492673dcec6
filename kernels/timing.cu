// Busy-waits `ns` nanoseconds of %globaltimer: keeps the stream busy while the host queues the
// work a benchmark times, so that launch overhead on the host does not show in device time.
extern "C" __global__ void spin(long long ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}
