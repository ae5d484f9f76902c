"""Measurements that bstrain reads at run time: the block-size advisor's tables (bstrain.advise)."""
