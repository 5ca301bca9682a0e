"""Projection: will a configuration fit, and how fast will it run? (`moetrain plan`).

hardware.py  profiles (profiles/*.yaml)      layout.py     stages per pipeline rank (grammar: config/pipeline_layout.py)
activations.py  saved-for-backward bytes     memory.py     per-rank memory and verdict
costs.py     per-block roofline              comm.py       collectives over a two-level network
schedule_orders.py  each rank's order, from torch's schedule classes (imports torch, pp > 1 only)
simulator.py pipeline schedules timed        perf.py       step time, MFU, bubbles
timeline.py  timeline format; run files      timeline_render.py  PNG (matplotlib) and HTML figures
report.py    tables and JSON                 measure.py    --measure (torch)
validate.py  plan validate (torch, GPU)      cli.py        argparse wiring
Everything but schedule_orders.py, measure.py and validate.py is pure Python: no torch import.
"""
