"""Drafters, one kind per module: the interface (`base`), context drafting with n-grams, a corpus and token
recycling (`ngram`), draft models (`draft_model`), draft heads on the target's own features (`head`), how scored
drafters grow their trees (`trees`), and the wrappers that fuse two drafters (`fused`, RASD) or draft ahead while
the target verifies (`ahead`, Saguaro). `ssmspec.speculate.defaults` turns generate's settings into one of
them."""

from ssmspec.speculate.drafters.ahead import AheadDrafter, DraftAheadDrafter
from ssmspec.speculate.drafters.base import Draft, Drafter, NoDrafter, accepted_path
from ssmspec.speculate.drafters.draft_model import DraftModelDrafter, TrimmedHead, check_keep, check_vocab, trim_vocab
from ssmspec.speculate.drafters.fused import FusedDrafter
from ssmspec.speculate.drafters.head import DraftHead, HeadDrafter
from ssmspec.speculate.drafters.ngram import PromptLookupDrafter

__all__ = [
    "AheadDrafter", "Draft", "DraftAheadDrafter", "DraftHead", "DraftModelDrafter", "Drafter", "FusedDrafter",
    "HeadDrafter", "NoDrafter",
    "PromptLookupDrafter", "TrimmedHead", "accepted_path", "check_keep", "check_vocab", "trim_vocab",
]  # fmt: skip
