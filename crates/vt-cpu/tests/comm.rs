//! The host communicator (threads as ranks) on the CPU backend: sums in rank order whatever order
//! the threads arrive in, gathers columns of uneven widths, and an aborted group wakes its waiters.

use std::thread;
use std::time::Duration;

use vt_core::{Communicator, Device, HostComm, Result};
use vt_cpu::CpuBackend;

/// Runs `f(rank, comm)` on one thread per rank; results in rank order.
fn on_ranks<T: Send>(n: usize, f: impl Fn(usize, &HostComm) -> T + Sync) -> Vec<T> {
    let comms = HostComm::group(n).unwrap();
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms.iter().enumerate().map(|(r, c)| s.spawn(move || f(r, c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((rank * 31 + i * 7) % 13) as f32 * 0.1 + 1e-7 * rank as f32).collect()
}

#[test]
fn all_reduce_sums_in_rank_order_on_every_rank() {
    for ranks in [1, 2, 3, 4] {
        let b = CpuBackend::new();
        let got = on_ranks(ranks, |r, c| -> Result<Vec<f32>> {
            // Arrive in reverse rank order: the sum must not depend on it.
            thread::sleep(Duration::from_millis(5 * (ranks - r) as u64));
            let x = b.from_f32(&[2, 3], &values(r, 6))?;
            b.to_f32(&c.all_reduce_sum(&b, &x)?)
        });
        let mut want = values(0, 6);
        for r in 1..ranks {
            want.iter_mut().zip(values(r, 6)).for_each(|(s, v)| *s += v);
        }
        for g in got {
            assert_eq!(g.unwrap(), want, "{ranks} ranks");
        }
    }
}

#[test]
fn all_gather_cols_puts_uneven_parts_side_by_side() {
    let b = CpuBackend::new();
    let widths = [3, 1, 2];
    let got = on_ranks(3, |r, c| -> Result<(Vec<usize>, Vec<f32>)> {
        let x = b.from_f32(&[2, widths[r]], &values(r, 2 * widths[r]))?;
        let y = c.all_gather_cols(&b, &x)?;
        Ok((y.shape().to_vec(), b.to_f32(&y)?))
    });
    let mut want = Vec::new();
    for row in 0..2 {
        for (r, &w) in widths.iter().enumerate() {
            want.extend_from_slice(&values(r, 2 * w)[row * w..(row + 1) * w]);
        }
    }
    for g in got {
        let (shape, v) = g.unwrap();
        assert_eq!(shape, [2, 6]);
        assert_eq!(v, want);
    }
}

#[test]
fn abort_wakes_ranks_waiting_in_a_collective() {
    let b = CpuBackend::new();
    let got = on_ranks(3, |r, c| -> Result<()> {
        if r == 2 {
            thread::sleep(Duration::from_millis(20));
            Communicator::<CpuBackend>::abort(c, "rank 2 failed");
            return Ok(());
        }
        let x = b.from_f32(&[1, 2], &[1.0, 2.0])?;
        c.all_reduce_sum(&b, &x).map(drop)
    });
    for (r, g) in got.iter().enumerate().take(2) {
        let e = g.as_ref().expect_err("waiting rank must fail").to_string();
        assert!(e.contains("aborted") && e.contains("rank 2 failed"), "rank {r}: {e}");
    }
    // A later call fails at once.
    let comms = HostComm::group(2).unwrap();
    Communicator::<CpuBackend>::abort(&comms[0], "gone");
    let x = b.from_f32(&[1, 1], &[1.0]).unwrap();
    assert!(comms[1].all_reduce_sum(&b, &x).is_err());
}

#[test]
fn mismatched_collectives_and_shapes_are_errors() {
    let b = CpuBackend::new();
    let got = on_ranks(2, |r, c| -> Result<()> {
        let x = b.from_f32(&[1, 2], &[1.0, 2.0])?;
        if r == 0 {
            c.all_reduce_sum(&b, &x).map(drop)
        } else {
            thread::sleep(Duration::from_millis(10));
            c.all_gather_cols(&b, &x).map(drop)
        }
    });
    assert!(got.iter().all(|g| g.as_ref().is_err_and(|e| e.to_string().contains("called"))), "{got:?}");
    let got = on_ranks(2, |r, c| -> Result<()> {
        let x = b.from_f32(&[1, 1 + r], &vec![1.0; 1 + r])?;
        c.all_reduce_sum(&b, &x).map(drop)
    });
    assert!(got.iter().all(|g| g.as_ref().is_err_and(|e| e.to_string().contains("shapes"))), "{got:?}");
    assert!(HostComm::group(0).is_err());
}
