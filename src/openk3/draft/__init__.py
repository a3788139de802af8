"""The MTP layer as a speculative draft (SPEC §11).

- `loss`: LK^alpha = -log sum_x min(p, q), KL and the hybrid LK^lambda, for training the draft.
- `model`: `EagleDraft`, the EAGLE-3-style draft (the target's MTP layer reading a fusion of three target hidden
  states), `tapped_hidden_states`, and the draft files of a checkpoint (`save_draft` / `load_draft`).
- `speculative`: rejection sampling that keeps the target's distribution (`accept_drafts`) and speculative
  generation over the model's decode cache with exact rollback of the KDA states (`speculative_generate`).
Training the draft is `openk3 draft` (openk3.train.draft); serving with it, `openk3 serve --speculative K`.
"""

from openk3.draft.loss import LOSSES, acceptance, draft_loss
from openk3.draft.model import EagleDraft, default_taps, has_draft, load_draft, save_draft, tapped_hidden_states
from openk3.draft.speculative import (
    SpeculationStats,
    accept_drafts,
    accept_drafts_on_logits,
    accept_greedy,
    draw,
    speculative_generate,
    target_distributions,
)

__all__ = ["LOSSES", "acceptance", "draft_loss", "EagleDraft", "default_taps", "has_draft", "load_draft",
           "save_draft", "tapped_hidden_states", "SpeculationStats", "accept_drafts", "accept_drafts_on_logits",
           "accept_greedy", "draw",
           "speculative_generate",
           "target_distributions"]
