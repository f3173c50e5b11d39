"""The `ssmspec` torch.compile backend (FX passes, lowering of tree ops to Triton kernels, Inductor)."""
