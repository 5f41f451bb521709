"""What both kernel families share: device helpers (common), the per-column softmax of a
register window (softmax), the fixed-order grad_ape sum (reduce), the serving kernels'
request walks (requests), the compile helper (entry) and torch's CUDA reduction order
(torch_order, pure Python: plans use it too). Nothing here imports the DSL at package import.
"""
