"""Drafters, one kind per module: the interface (`base`), context drafting with n-grams, a corpus and token
recycling (`ngram`), draft models and their trees (`draft_model`), and the wrappers that fuse two drafters
(`fused`, RASD) or draft ahead while the target verifies (`ahead`, Saguaro). `ssmspec.speculate.defaults`
turns generate's settings into one of them."""

from ssmspec.speculate.drafters.ahead import AheadDrafter, DraftAheadDrafter
from ssmspec.speculate.drafters.base import Draft, Drafter, NoDrafter, accepted_path
from ssmspec.speculate.drafters.draft_model import DraftModelDrafter, TrimmedHead, check_keep, check_vocab, trim_vocab
from ssmspec.speculate.drafters.fused import FusedDrafter
from ssmspec.speculate.drafters.ngram import PromptLookupDrafter

__all__ = [
    "AheadDrafter", "Draft", "DraftAheadDrafter", "DraftModelDrafter", "Drafter", "FusedDrafter", "NoDrafter",
    "PromptLookupDrafter", "TrimmedHead", "accepted_path", "check_keep", "check_vocab", "trim_vocab",
]  # fmt: skip
