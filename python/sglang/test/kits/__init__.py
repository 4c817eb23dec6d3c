"""Client kits that upstream's benchmark scripts import from ``sglang.test.kits``."""
