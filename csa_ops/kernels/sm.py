"""What one SM of the supported archs (SM90 and SM100, the same on both) holds: the limits
the families' launch plans count CTAs against. Pure Python, no DSL: plans are chosen
without a device (a key compiles for an arch it does not run on)."""

SMEM_PER_SM = 228 * 1024  # bytes of shared memory
RESERVED_SMEM_PER_CTA = 1024  # of it, taken by the system from each resident CTA
# What the plans let their CTAs' dynamic shared memory add up to on one SM (one CTA's
# reserve off): the most a single CTA may ask for.
SMEM_FOR_CTAS = SMEM_PER_SM - RESERVED_SMEM_PER_CTA
REGISTER_FILE = 64 * 1024  # 32-bit registers
# The registers are four sub-partitions', each holding its warps' registers: a warp's
# registers come from one, so an SM holds 4 * (registers a sub-partition // a warp's) warps.
SUB_PARTITIONS = 4
MAX_THREADS = 2048
MAX_CTAS = 32
REGISTER_GRANULE = 8  # registers a thread are allocated in multiples of this
MAX_REGISTERS = 255  # a thread's at most (the rest spills)
