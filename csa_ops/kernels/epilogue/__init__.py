"""The row epilogue after pooling: RMSNorm, RoPE, the Hadamard rotation, and for serving one
cache format and the paged store, one CTA per pooled row. plan.py is the host side (keys,
support); rows.py the steps both kernels share; store.py (serving) and training.py (the
training forward) the kernel classes, imported only through kernels.families.launch_entry."""
