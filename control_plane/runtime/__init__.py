"""Processes: the control-plane service and mmctl up's supervisor."""
