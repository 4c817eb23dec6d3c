"""Hybrid HiCache stacks: a HostPoolGroup behind one controller, one builder per stack kind."""
