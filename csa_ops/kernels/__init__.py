"""CuTe-DSL kernel families of the compressor: window (register windows) and streaming (large
windows), each a package with its DSL-free plan and its kernel classes; shared/ holds what
both use. families.py is the registry and the family contract.
"""

from .families import FAMILIES, KERNELS, launch_entry, select_key

__all__ = ["FAMILIES", "KERNELS", "launch_entry", "select_key"]
