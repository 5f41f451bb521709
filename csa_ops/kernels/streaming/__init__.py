"""Streaming kernels for large windows: window tiles through a cp.async pipeline in shared
memory. plan.py is the host side; kernels.py (forward, backward) and extend.py the kernel
classes (imported only through kernels.families.launch_entry)."""
