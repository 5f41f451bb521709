"""Register-window kernels (windows coff * ratio <= plan.WINDOW_MAX): a row's whole window
lives in registers. plan.py is the host side; forward.py, backward.py and extend.py the
kernel classes (imported only through kernels.families.launch_entry)."""
