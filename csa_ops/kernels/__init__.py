"""CuTe-DSL kernel families of the compressor (see csa_ops.host.KernelFamily for the contract).

Per family, a plan module without the DSL (window_plan, streaming_plan: keys, support,
launch plans) and a device module (window: register-window kernels for coff * ratio <=
window_plan.WINDOW_MAX; streaming: large windows). common and reduce hold shared device code,
requests the request helpers of both families' csa::compressor_extend kernels (extend_plan
picks the family's: extend.py, or streaming.py's extend kernel).
"""

from .families import FAMILIES, select_key

__all__ = ["FAMILIES", "select_key"]
