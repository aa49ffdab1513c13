"""The Monitor tab (slots, process, host, GPUs) and Cache health."""
