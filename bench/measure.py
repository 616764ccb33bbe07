"""What every benchmark measures its figures with: CUDA-event times, the dense-matmul and HBM
ceilings of the same run, and rel-L2 errors pooled in float64 (MEASURE.md)."""
import statistics

import torch


def event_times(fn, iters, warmup=3, before=None):
    """Milliseconds of each of iters calls of fn() (after warmup untimed ones), CUDA events around
    each call; before(), when given, runs ahead of each timed call, outside the events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def timed(fn, iters=10, warmup=3):
    """Median, min, max milliseconds of fn() with CUDA events around each call."""
    times = event_times(fn, iters, warmup)
    return statistics.median(times), min(times), max(times)


def ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _, _ = timed(lambda: a @ b)
    bf16 = 2 * 8192 ** 3 / ms / 1e9
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms_copy, _, _ = timed(lambda: dst.copy_(src))
    copy_GBps = 2 * src.numel() / ms_copy / 1e6
    # Write-only stream: the roof of GEMMs whose output outweighs their operands (WGRAD with few
    # rows per expert writes more bytes of weight gradient than it reads).
    ms_fill, _, _ = timed(lambda: dst.fill_(7))
    write_GBps = dst.numel() / ms_fill / 1e6
    del a, b, src, dst
    return {"bf16_matmul_tflops": bf16, "fp8_matmul_tflops": fp8_ceiling(), "peer_store_GBps": None,
            "hbm_copy_GBps": copy_GBps, "hbm_write_GBps": write_GBps}


def fp8_ceiling():
    """Dense 8192^3 e4m3 matmul with per-tensor scales (torch._scaled_mm), TFLOP/s; None where
    this torch has no fp8 matmul."""
    try:
        a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device="cuda")
        ms, _, _ = timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                  out_dtype=torch.bfloat16))
        return 2 * 8192 ** 3 / ms / 1e9
    except (RuntimeError, AttributeError, TypeError) as e:
        print(f"fp8 ceiling unavailable: {e}", flush=True)
        return None


def rel_l2_parts(a, b, chunk=1 << 26):
    """(||a - b||^2, ||b||^2) in float64 sums over float32 chunks (weight gradients are ~1e10
    elements); parts of several ranks pool by adding."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    num = den = 0.0
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        num += float(((x - y) ** 2).sum(dtype=torch.float64))
        den += float((y ** 2).sum(dtype=torch.float64))
    return num, den


def rel_l2(a, b, chunk=1 << 26):
    """||a - b|| / ||b||."""
    num, den = rel_l2_parts(a, b, chunk)
    return (num / max(den, 1e-300)) ** 0.5
