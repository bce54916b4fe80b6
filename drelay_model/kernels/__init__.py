"""Triton kernels for the DRelay selector's hot path (optional: needs the `triton` package).

candidate_read.py  Global Read's candidate-specific attention (Eq. 1): draft log-q prior,
                   relative-position bias and the zero null key/value fused into one softmax.
walk.py            the causal decision walk (selectors/drelay/walk.py), one program per row.

The PyTorch implementations stay the reference (`DRelayConfig.kernels = "torch"`, the default);
`kernels = "triton"` routes the selector here. Kernels run on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1` (slow; the tests use it). Nothing here is imported unless asked for.
"""
