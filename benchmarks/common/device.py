"""The benchmarks' device chores: waiting for CUDA's queued work, and paying cuBLAS's
one-time workspaces before anything is measured. Both are no-ops on the CPU."""

import torch


def sync(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` (CUDA), so a clock read after it
    counts them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up_cublas(device: torch.device) -> None:
    """Have cuBLAS allocate its workspaces now, before any impl's memory is counted.

    cuBLAS takes a workspace (32 MiB on Hopper) from the caching allocator at the first
    matmul of each handle and stream, and keeps it for the process. Forward matmuls run
    on this thread's handle, backward ones on the autograd device thread's: without this
    warm-up the impl measured first would carry both (64 MiB) in its peak and states,
    and the others none. A matmul with a bias too, in case cuBLASLt (addmm) keeps its
    own workspace. Constant inputs: no random number is drawn.
    """
    if device.type != "cuda":
        return
    x = torch.ones(8, 64, device=device, requires_grad=True)  # (batch, in)
    weight = torch.ones(64, 64, device=device, requires_grad=True)  # (out, in)
    bias = torch.ones(64, device=device, requires_grad=True)
    torch.nn.functional.linear(x, weight).sum().backward()
    torch.nn.functional.linear(x, weight, bias).sum().backward()
    sync(device)
