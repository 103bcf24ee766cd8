"""The fault battery's cases, one module per kind of fault (run them with ``benchmarks/fault_battery.py``)."""
