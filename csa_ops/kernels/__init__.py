"""CuTe-DSL kernel families of the compressor (see csa_ops.host.KernelFamily for the contract).

window: register-window kernels for coff * ratio <= config.WINDOW_MAX.
streaming: kernels for large ratios.
common: device helpers shared by the families.
"""
