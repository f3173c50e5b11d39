"""torch.library custom ops: the semantic contract of ssmspec's tree verification (plain PyTorch references)."""

from ssmspec.ops.commit import conv_window, gather_states
from ssmspec.ops.conv import tree_causal_conv1d
from ssmspec.ops.delta_rule import tree_delta_rule
from ssmspec.ops.selective_scan import tree_selective_scan
from ssmspec.ops.ssd import ssd_state_at, tree_ssd

__all__ = [
    "conv_window",
    "gather_states",
    "ssd_state_at",
    "tree_causal_conv1d",
    "tree_delta_rule",
    "tree_selective_scan",
    "tree_ssd",
]
