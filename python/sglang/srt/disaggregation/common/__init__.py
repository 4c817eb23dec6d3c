"""Transport-free parts of PD transfer: bootstrap server, rank mapping, head slicing, peer checks."""
