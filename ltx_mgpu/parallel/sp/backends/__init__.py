"""All2all backends. Each module registers its factory with `ltx_mgpu.parallel.sp.all2all.register_backend`
when imported; `all2all.get_backend_factory` imports the built-in ones lazily by name:

- `dist`: torch.distributed all_to_all_single (gloo on CPU, NCCL on CUDA); always available.
- `ipc`: the CUDA-IPC kernel from `kernels/` (owned by the kernel engineer); CUDA only.
"""
