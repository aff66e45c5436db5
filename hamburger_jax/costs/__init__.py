"""What programs cost: the analytic FLOP and byte counts of HAMburger's programs (analytic.py),
the same counted from traced and compiled programs (program_flops.py), and the devices' peaks,
MFU and roofline arithmetic (peaks.py)."""
