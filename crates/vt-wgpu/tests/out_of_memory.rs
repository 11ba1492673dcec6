//! An adapter out of memory is an error that says so, and the backend goes on working: wgpu's
//! default is to panic. This file is a process of its own because it caps the process's address
//! space (`RLIMIT_AS`): that is how lavapipe, whose device memory is host memory the kernel
//! overcommits, runs out. A GPU runs out of its own memory first, or of the capped address space.
#![cfg(target_os = "linux")]

use vt_core::backend::prelude::*;
use vt_core::DType;
use vt_wgpu::WgpuBackend;

fn address_space_limit() -> libc::rlimit {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit through a pointer to a live, writable one.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) }, 0, "getrlimit");
    limit
}

fn set_address_space_limit(limit: libc::rlimit) {
    // SAFETY: setrlimit reads one rlimit through a pointer to a live one.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0, "setrlimit");
}

/// The process's mapped address space, in bytes.
fn address_space_used() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib = status.lines().find_map(|l| l.strip_prefix("VmSize:")).expect("VmSize");
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().expect("VmSize in kB") * 1024
}

/// `f`'s result with the address space capped at what the process uses now plus `extra` bytes.
fn with_address_space<T>(extra: u64, f: impl FnOnce() -> T) -> T {
    let original = address_space_limit();
    set_address_space_limit(libc::rlimit { rlim_cur: address_space_used() + extra, ..original });
    let r = f();
    set_address_space_limit(original);
    r
}

#[test]
fn a_buffer_the_adapter_cannot_hold_is_an_error_and_the_backend_goes_on() {
    let b = WgpuBackend::new().expect("a wgpu adapter");
    let before = b.from_f32(&[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    // 2 GiB less a little (within the adapter's buffer limit), up to 1 TiB in all.
    let big = [(1usize << 29) - 64];
    let refused = with_address_space(1 << 30, || {
        let mut held = Vec::new();
        (0..512).find_map(|_| b.zeros_f32(&big).map(|t| held.push(t)).err())
    });
    let e = refused.expect("1 TiB of buffers with 1 GiB of address space left is refused").to_string();
    assert!(e.contains("2147483392 bytes") && e.contains("out of memory"), "{e}");

    // An upload's staging buffer: with room for a 1 GiB tensor but not for its staging copy too,
    // the tensor alone is made and the upload of one is refused. The room is half a GiB, plus
    // what such a tensor itself takes of the address space (lavapipe's device memory is the
    // process's; a GPU's is not).
    let gib = [1usize << 28];
    let tensor_space = {
        let before = address_space_used();
        let _tensor = b.zeros_f32(&gib).unwrap();
        address_space_used().saturating_sub(before)
    };
    b.synchronize().unwrap();
    let room = tensor_space + (1 << 29);
    let alone = with_address_space(room, || b.zeros_f32(&gib).map(drop));
    assert!(alone.is_ok(), "a 1 GiB tensor alone fits: {alone:?}");
    b.synchronize().unwrap();
    let bytes = vec![0u8; 1 << 30];
    let upload = with_address_space(room, || b.upload(DType::F32, &gib, &bytes).map(drop));
    let e = upload.expect_err("uploading 1 GiB without room for its staging copy is refused").to_string();
    assert!(e.contains("1073741824 bytes") && e.contains("out of memory"), "{e}");

    let after = b.from_f32(&[4], &[5.0, 6.0, 7.0, 8.0]).unwrap();
    let sum = b.add(&before, &after).unwrap();
    assert_eq!(b.to_f32(&sum).unwrap(), [6.0, 8.0, 10.0, 12.0]);
}
