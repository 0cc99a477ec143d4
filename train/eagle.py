"""Train an EAGLE draft layer (EAGLE-1 or EAGLE-3) on a frozen base.

    accelerate launch train/eagle.py recipes/smollm2-135m-eagle.yaml [section.key=value ...]

EAGLE-1 (Li et al. 2024, arXiv:2401.15077): the pair (embed(x_{t+1}), f_t) predicts the base's
next feature f_{t+1}; loss = SmoothL1(f_hat, f) + 0.1 * soft CE(lm_head(f_hat), p_{t+1}), with
uniform noise on the input features.
EAGLE-3 (Li et al. 2025, arXiv:2503.01840): the first input fuses three base layers; training-time
test (TTT) unrolls `ttt_steps` draft steps, step j feeding the draft's own output from step j-1
(as at inference) and the true token x_{t+1+j}; step j's query at t attends to step 0's keys
at positions <= t and to its own chain's keys at t from steps 1..j. Loss: sum_j decay^j * soft CE
over the draft vocabulary (the base's distribution restricted and renormalised), summed over
the steps' tokens and divided by the target tokens (per token, as train.steps.step_norms says). The draft vocabulary (d2t / t2d) is built once from the data
and saved before step 1; a resumed run reuses it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import PartialState
from tqdm.auto import tqdm
from transformers import DynamicCache

from heads import EagleConfig, EagleDraft
from heads.base import output_logits
from heads.checkpoint import load_state_checked
from heads.eagle import check_vocab_map
from train.checkpoint import (
    base_identity,
    begin_run,
    check_finite,
    load_checkpoint,
    resumed_line,
    run_folder,
    save_checkpoint,
)
from train.config import Recipe
from train.console import warnings_as_lines
from train.features import base_features, base_targets, collate, draft_vocabulary
from train.init_heads import read_init_heads
from train.losses import (
    count,
    ratio_means,
    shift_left,
    sim_tau,
    soft_target_ce,
    top_ids,
    walk_accept_length,
)
from train.outputs import MetricsLog, record_training_setup, save_final
from train.run import (
    Trainee,
    assert_trainable,
    base_dtype_for_training,
    evaluate,
    find_resume,
    gather_for_reading,
    load_frozen_base,
    make_accelerator,
    prepare_data,
    run_training,
    stop_on_bad_input,
)
from train.steps import clip_gradients, count_steps, epoch_batches, make_optimizer, step_norms
from train.zero import keep_rotary_in_fp32


def ttt_mask(T: int, step: int, key_pad: torch.Tensor, dtype) -> torch.Tensor:
    """Additive mask (B,1,T,(step+1)T) for TTT step `step`: causal over step 0's keys, then the
    same position only in each later step's keys; padded keys (key_pad (B,T) True) blocked."""
    device = key_pad.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diag = torch.eye(T, dtype=torch.bool, device=device)
    allowed = torch.cat([causal] + [diag] * step, dim=1)[None]  # (1,T,(step+1)T)
    allowed = allowed & ~key_pad.repeat(1, step + 1)[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    return mask[:, None]


class EagleTrainee(Trainee):
    """The frozen base and the draft layer (`heads`). forward(batch, step) -> (loss, metrics)."""

    def __init__(self, base, draft: EagleDraft, recipe: Recipe) -> None:
        super().__init__()
        self.base, self.heads = base, draft
        self.spec, self.decay = recipe.heads, recipe.training.loss_decay
        self.aux_ids = tuple(draft.config.aux_layer_ids) if draft.config.version == 3 else ()
        self.seed = recipe.training.seed
        self._noise_at = (-1, 0)  # (step, micro-batches noised in it so far)

    def forward(self, batch: dict[str, torch.Tensor], step: int = 0, norm: float | None = None):
        """(loss, metrics). The loss is the sum over target tokens (and TTT steps) divided by
        `norm`: the mean target count of the optimizer step's micro-batches (`step_norms`), so
        that each token weighs the same in the step; None divides by this batch's own count.
        Metrics are (sum, number) pairs: a training log divides them per batch, `evaluate` sums
        them over the held-out split."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        if "hidden" in batch:
            feats = {k: batch[k] for k in ("hidden", "aux") if k in batch}
        else:
            feats = base_features(self.base, ids, attn, self.aux_ids)
        with torch.no_grad():
            embeds = self.base.get_input_embeddings()(shift_left(ids, 1))  # embed(x_{t+1}) (B,T,H)
            next_is_target = shift_left(batch["loss_mask"].bool(), 1, False)
            # A decode step starts at row t when its root (t + 1) and first target (t + 2) are
            # answer tokens: walk_tau's rows.
            starts = next_is_target & shift_left(next_is_target, 1, False)
            row_of = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
            row_of[next_is_target] = torch.arange(int(next_is_target.sum()), device=ids.device)
        # The base's logits at the target rows, once per batch: EAGLE-1 reads the whole
        # vocabulary (it shares the base's lm_head), EAGLE-3 its draft vocabulary.
        v3 = self.heads.config.version == 3
        # the base ids of the draft's logits, in the draft's order (d2t may map in any order)
        draft_ids = None
        if v3:
            draft_ids = self.heads.to_base_ids(torch.arange(len(self.heads.d2t), device=ids.device))
        base_logits, base_top, _ = base_targets(
            self.base,
            feats["hidden"][next_is_target],
            draft_ids,
            batch["top"][next_is_target] if "top" in batch else None,
        )  # (p, V or V_draft), (p,)
        # The draft trains in fp32 whatever the base's dtype.
        dtype = self.heads.fc.weight.dtype
        feats = {k: v.to(dtype) for k, v in feats.items()}
        embeds = embeds.to(dtype)
        n = norm if norm is not None else max(int(next_is_target.sum()), 1)
        if not v3:
            return self._eagle1(
                feats["hidden"], embeds, next_is_target, starts, row_of, base_logits, step, n
            )
        return self._eagle3(
            feats["aux"], embeds, attn, next_is_target, starts, row_of, base_logits, base_top, n
        )

    def _eagle1(self, hidden, embeds, next_is_target, starts, row_of, base_logits, step, n):
        B, T, H = hidden.shape
        x = hidden
        if self.training and self.spec.feature_noise > 0:
            # Seeded by step, micro-batch and process: resume is exact, and no two micro-batches
            # (of one step's accumulation, or of two processes) draw the same noise.
            done, calls = self._noise_at
            calls = calls + 1 if done == step else 0
            self._noise_at = (step, calls)
            rank = PartialState().process_index
            seed = ((self.seed * 1_000_003 + step) * 1_009 + calls) * 65_537 + rank
            g = torch.Generator(device=hidden.device).manual_seed(seed % 2**63)
            x = (
                hidden
                + (torch.rand(hidden.shape, generator=g, device=hidden.device) - 0.5)
                * self.spec.feature_noise
            )
        pos = torch.arange(T, device=hidden.device).expand(B, T)
        out = self.heads(embeds, x, pos)  # (B,T,H): predicted f_{t+1}
        valid = shift_left(
            next_is_target, 1, False
        )  # the token after f_{t+1}, x_{t+2}, is a target
        pred, true = out[valid], shift_left(hidden, 1)[valid]
        rows = shift_left(row_of, 1, -1)[valid]
        target = base_logits[rows].float().softmax(-1)
        # EAGLE-1 shares the base lm_head, and its logits are the base's for f_{t+1}: scaled as
        # the base's forward scales them (Granite, Cohere, Gemma-2), as the targets are
        logits = output_logits(self.base, pred)
        own = int(next_is_target.sum())
        feature_loss = F.smooth_l1_loss(pred.float(), true.float(), reduction="sum") / (n * H)
        token_loss = soft_target_ce(logits, target) / n
        loss = (
            self.spec.feature_loss_weight * feature_loss + self.spec.token_loss_weight * token_loss
        )
        top1 = logits.argmax(-1) == target.argmax(-1)
        metrics = {
            # per target token (the loss's divisor may be its step's)
            "feature_loss": (float(feature_loss.detach()) * n, own),
            "token_loss": (float(token_loss.detach()) * n, own),
            "step0/top1": count(top1),
        }
        ok = torch.zeros(valid.shape, dtype=torch.bool, device=hidden.device)
        ok[valid] = top1
        metrics["sim_tau"] = sim_tau([ok], next_is_target)
        if not self.training:  # a Python walk over the rows: evaluation only
            metrics["walk_tau"] = walk_accept_length(ok[None], starts)
        return loss, metrics

    def _eagle3(self, aux, embeds, attn, next_is_target, starts, row_of, draft_logits, base_top, n):
        """draft_logits (p, V_draft): the base's logits on the draft vocabulary at the target
        rows; base_top (p,) its greedy tokens there; n the loss's divisor."""
        B, T, _ = aux.shape
        draft = self.heads
        # The base's distribution restricted to the draft vocabulary and renormalised is the
        # softmax of its logits there.
        targets = draft_logits.float().softmax(-1)  # (p, V_draft)
        hidden = draft.fuse(aux)
        cache = DynamicCache(config=draft.llama_config)
        pos = torch.arange(T, device=aux.device).expand(B, T)
        # A row whose greedy token the draft vocabulary lacks trains nothing (as in the EAGLE-3
        # reference): the draft can never propose that token, and the base's distribution
        # renormalised on the rest would teach one that verification rejects there.
        drafted = draft.t2d[base_top]  # (p,)
        loss = aux.new_zeros(())
        correct, metrics = [], {}  # (B,T) per step: right at that row
        for j in range(self.spec.ttt_steps):
            valid = shift_left(
                next_is_target, j + 1, False
            )  # target x_{t+2+j} is an assistant token
            if not valid.any():
                break
            mask = ttt_mask(T, j, attn == 0, hidden.dtype)
            out = draft(
                shift_left(embeds, j), hidden, pos + j, attention_mask=mask, cache=cache
            )  # (B,T,H)
            logits = draft.compute_logits(out[valid])  # (n_j, V_draft)
            rows = shift_left(row_of, j + 1, -1)[valid]
            keep = drafted[rows]
            loss = loss + self.decay**j * soft_target_ce(logits[keep], targets, rows[keep]) / n
            # the top 4: the width of the CPU trees (a right token among them is accepted)
            hits = top_ids(logits, 4, draft.to_base_ids) == base_top[rows, None]  # (n_j, 4)
            ok = torch.zeros(valid.shape, dtype=torch.bool, device=aux.device)
            ok[valid] = hits[:, 0]
            correct.append(ok)
            metrics[f"step{j}/top1"] = count(ok[valid])
            metrics[f"step{j}/top4"] = count(hits.any(-1))
            hidden = out
        metrics["sim_tau"] = sim_tau(correct, next_is_target)
        if not self.training and correct:  # a Python walk over the rows: evaluation only
            metrics["walk_tau"] = walk_accept_length(torch.stack(correct), starts)
        return loss, metrics


def build_draft(
    recipe: Recipe, base, train_ds, accelerator, ckpt: Path | None
) -> tuple[EagleDraft, torch.Tensor | None]:
    """The draft and the EAGLE-3 draft vocabulary built from the data, which `begin_run` keeps
    for a resumed run to use again (None: EAGLE-1, or `training.init_heads`, whose weights and
    vocabulary are taken)."""
    spec = recipe.heads
    unused = spec.unused_eagle_settings()
    if unused:
        other = 3 if spec.version == 1 else 1
        accelerator.print(
            f"note: {', '.join(unused)}: EAGLE-{other}'s, unused by this EAGLE-{spec.version} "
            "draft (heads.version)"
        )
    with stop_on_bad_input():  # aux layers out of order
        cfg = EagleConfig.from_base(
            base.config,
            version=spec.version,
            draft_vocab_size=spec.draft_vocab_size,
            aux_layer_ids=spec.aux_layer_ids,
        )
        record_training_setup(cfg, recipe)
    draft = EagleDraft(cfg, attn_implementation=recipe.model.attn_implementation)
    if recipe.training.init_heads:  # their weights and draft vocabulary (d2t / t2d)
        tensors, where = read_init_heads(recipe, cfg, base)  # found (or downloaded) by parse_args
        with stop_on_bad_input():
            load_state_checked(draft, tensors, where)
            if spec.version == 3:
                check_vocab_map(draft.d2t, draft.t2d)
        accelerator.print(f"the draft starts from {where} (training.init_heads)")
        return draft.to(base.device), None
    vocab = None
    if spec.version == 3:  # built once from the data, saved before step 1, reused on resume
        with stop_on_bad_input():
            vocab = draft_vocabulary(
                train_ds.examples,
                cfg.draft_vocab_size,
                base.config.vocab_size,
                run_folder(ckpt),  # the run that wrote the checkpoint keeps it
            )
        draft.set_vocab_map(vocab)
        if spec.init_from_base:
            decoder = base.get_decoder()
            read = [decoder.layers[-1], decoder.norm, base.get_output_embeddings()]
            # every process at once: under ZeRO-3 gathering the base's shards is a collective
            with gather_for_reading(*(p for module in read for p in module.parameters())):
                notes = draft.init_from_base(base)
            for note in notes:
                accelerator.print(f"heads.init_from_base: {note}")
    return draft.to(base.device), vocab


def training_function(recipe: Recipe) -> dict:
    accelerator = make_accelerator(recipe)
    ckpt = find_resume(recipe, accelerator)
    dtype = base_dtype_for_training(recipe, accelerator, ckpt)
    base, tokenizer = load_frozen_base(recipe, accelerator, dtype)
    with stop_on_bad_input():  # other weights than the checkpoint's
        identity = base_identity(base, ckpt)
    spec = recipe.heads
    aux_ids = []
    if spec.version == 3:
        aux_ids = spec.aux_layer_ids or EagleConfig.from_base(base.config).aux_layer_ids
    train_ds, eval_ds, data_identity = prepare_data(
        recipe, base, tokenizer, accelerator, aux_ids, ckpt
    )
    identity |= data_identity
    draft, vocab = build_draft(recipe, base, train_ds, accelerator, ckpt)
    model = EagleTrainee(base, draft, recipe)
    assert_trainable(model, draft.num_trainable_parameters(), accelerator)
    per_epoch, total = count_steps(len(train_ds), recipe, accelerator)
    optimizer, scheduler = make_optimizer(
        recipe, [p for p in draft.parameters() if p.requires_grad], total
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    keep_rotary_in_fp32(accelerator.unwrap_model(model))  # DeepSpeed's bf16 cast them
    step, epoch, skip, best = 0, 0, 0, {}
    if ckpt is not None:
        state = load_checkpoint(accelerator, ckpt, optimizer, scheduler)
        step, epoch, skip, best = (
            state["step"],
            state["epoch"],
            state["batch_in_epoch"],
            state.get("metrics", {}),
        )
        with stop_on_bad_input():
            accelerator.print(resumed_line(ckpt, step, total))
    begin_run(recipe, ckpt, accelerator, vocab)  # all loaded: the earlier run's files go now
    log = MetricsLog(recipe, accelerator, step)
    pad_id, device = tokenizer.pad_token_id, accelerator.device
    eval_every = recipe.training.eval_every_steps or per_epoch
    save_every = recipe.training.save_every_steps or per_epoch
    bar = tqdm(
        total=total,
        initial=step,
        desc=f"eagle-{spec.version}",
        disable=not accelerator.is_main_process,
    )
    tokens, t0 = 0, time.perf_counter()
    step_losses: list[float] = []  # this optimizer step's micro-batch losses
    model.train()
    while step < total:
        batches = epoch_batches(len(train_ds), recipe, epoch, accelerator)
        norms = step_norms(train_ds, batches, recipe, accelerator)
        for bi in range(skip, len(batches)):
            batch = collate(train_ds, batches[bi], pad_id, device)
            with accelerator.accumulate(model):
                loss, metrics = model(batch, step, norms[bi])
                # Every micro-batch, before any update: a NaN never reaches the weights or a
                # checkpoint (a collective, so every process stops together).
                loss_value = float(accelerator.reduce(loss.detach(), "mean"))
                check_finite(loss_value, step + 1, recipe.output.dir)
                step_losses.append(loss_value)
                lr = scheduler.get_last_lr()[0]  # the rate this update uses
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    clip_gradients(accelerator, model, recipe, step + 1)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            tokens += int(batch["attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            step += 1
            step_loss, step_losses = sum(step_losses) / len(step_losses), []
            bar.update(1)
            if step % recipe.logging.log_every_steps == 0 or step == total:
                rate = tokens * accelerator.num_processes / (time.perf_counter() - t0)
                means = ratio_means(metrics)  # this micro-batch's; loss: per token of the step
                log.log({"loss": step_loss, "lr": lr, "tokens_per_s": rate, **means}, step)
                bar.set_postfix(loss=f"{step_loss:.3f}", top1=f"{means.get('step0/top1', 0):.2f}")
            if step % eval_every == 0 or step == total:
                best = (
                    evaluate(accelerator.unwrap_model(model), eval_ds, recipe, pad_id, device)
                    if len(eval_ds)
                    else {}
                )
                log.log(best, step)
                if accelerator.is_main_process:  # on a line of its own, the bar redrawn below
                    bar.write(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in best.items()))
            done_epoch = bi + 1 == len(batches)
            if step % save_every == 0 or step == total:
                state = {
                    "step": step,
                    "epoch": epoch + done_epoch,
                    "batch_in_epoch": 0 if done_epoch else bi + 1,
                    "metrics": best,
                    **identity,
                }
                save_checkpoint(
                    accelerator,
                    recipe.output.dir,
                    recipe,
                    state,
                    recipe.training.keep_last_checkpoints,
                )
            if step >= total:
                break
        epoch, skip = epoch + 1, 0
    bar.close()
    save_final(recipe, accelerator.unwrap_model(model).heads, accelerator, best)
    accelerator.end_training()
    return best


def main(argv: list[str] | None = None) -> None:
    run_training(training_function, argv, "eagle")


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        main()
