"""The model's own loss: causal-lm (next-token cross-entropy on text, chat or prompt-completion samples), image-text
(the same on chats with images) and seq-cls (cross-entropy on the label): no objective of zerotrain's, data from disk
(map-style or a stream), evaluated as loss and perplexity or accuracy."""
from __future__ import annotations

import math
from typing import Any

import torch

from ...data.datasets import eval_loader, real_tokens
from ...distributed.collectives import reduce_sum
from .base import Recipe
from .sources import data_source


class LMRecipe(Recipe):
    """causal-lm, image-text: the model's next-token loss; evaluated as loss and perplexity."""

    classifier = False
    """The eval counts each sample's label (accuracy) rather than each next token (perplexity)."""

    def __init__(self, setup: Any, engine: Any):
        super().__init__(setup, engine)
        self.source = data_source(setup, engine)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """Loss and perplexity (causal LM) or accuracy (classifier) of the model's own outputs."""
        e, plan, classes = self.engine, self.plan, self.classifier
        e.eval()
        loss_sum = count = correct = torch.zeros((), dtype=torch.float64, device=e.device)  # read once, at the end
        with torch.no_grad():
            for batch in eval_loader(self.s.data, e.dp_rank, plan.world.dp, plan.batch.micro_batch):
                valid = batch.pop("valid").to(e.device)
                labels = batch.pop("labels").to(e.device)
                real_tokens(batch)  # a packed batch's token count is no model input
                logits = e.eval_step(batch)
                if logits is None:  # a pipeline stage before the last: no output here, nothing to count
                    continue
                logits = logits.float()
                if classes:
                    per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
                    loss_sum = loss_sum + per[valid].sum()
                    correct = correct + (logits.argmax(-1) == labels)[valid].sum()
                    count = count + valid.sum()
                else:
                    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
                    per = torch.nn.functional.cross_entropy(shift_logits.transpose(1, 2), shift_labels,
                                                            ignore_index=-100, reduction="none")
                    tok = (shift_labels != -100) & valid[:, None]
                    loss_sum = loss_sum + per[tok].sum()
                    count = count + tok.sum()
        e.train()
        share = 1.0 if plan.world.counts_for_data(e.rank) else 0.0  # each replica's batches count once
        loss_sum, count, correct = reduce_sum(share * float(loss_sum), share * float(count), share * float(correct))
        out = {"eval_loss": loss_sum / max(count, 1.0)}
        if classes:
            out["eval_accuracy"] = correct / max(count, 1.0)
        else:
            out["eval_perplexity"] = math.exp(min(out["eval_loss"], 80.0))
        return out


class ClassifierRecipe(LMRecipe):
    """seq-cls: the model's cross-entropy on the label; evaluated as loss and accuracy."""

    classifier = True
