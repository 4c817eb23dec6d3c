"""The HiCache controller's parts (``managers/cache_controller.py`` holds the controller itself):
transfer lanes and layer-done counters for L1<->L2, the L2<->L3 storage controller with its
operations and checked backend calls, and the HiCache settings."""
