"""The row epilogue after pooling: RMSNorm, RoPE, the Hadamard rotation, one cache format and
the paged store, one CTA per pooled row. plan.py is the host side (keys, support); kernels.py
the kernel class (imported only through kernels.families.launch_entry)."""
