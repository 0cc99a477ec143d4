"""Train Medusa heads on a frozen base (Medusa-1), or with LoRA on the base (Medusa-2).

    accelerate launch train/medusa.py recipes/smollm2-135m-medusa.yaml [section.key=value ...]

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". Head k reads the base's last hidden state h_t and learns token t+k+2 with loss
sum_k decay^k * CE, against the base's own distribution at t+k+1 (soft labels, default) or the
data's token. Medusa-2 also adapts the base with LoRA (peft), kept close to the original base by
a KL term, with a larger learning rate for the heads and a warmup ramp of their loss weight.
Writes OUTPUT/heads (vLLM's MedusaModel layout), checkpoints and metrics.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from heads import MedusaConfig, MedusaHeads
from heads.base import logits_scaling, output_logits
from heads.checkpoint import load_state_checked
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


class MedusaTrainee(Trainee):
    """The base (frozen; LoRA-adapted in Medusa-2) and the heads. forward -> (loss, metrics)."""

    def __init__(self, base, heads: MedusaHeads, recipe: Recipe) -> None:
        super().__init__()
        self.base, self.heads = base, heads
        self.lora = recipe.heads.lora_r > 0
        self.decay, self.soft = recipe.training.loss_decay, recipe.training.soft_labels
        self.kl_weight = recipe.heads.kl_weight
        self.warmup = recipe.heads.heads_loss_warmup_steps
        # The heads' logits are trained as the base's: scaled as its forward scales its own
        # (Granite, Cohere, Gemma-2), so a fresh head is the base's distribution and a shared,
        # frozen lm_head can match the targets' scale. Drafting reads their ranks only.
        self.scaling = logits_scaling(base)
        V = base.config.vocab_size
        draft_of = torch.full((V,), -1, dtype=torch.long)  # base id -> draft id (-1: not drafted)
        ids = heads.token_map if heads.token_map is not None else torch.arange(V)
        draft_of[ids.cpu()] = torch.arange(ids.numel())
        self.register_buffer("draft_of", draft_of, persistent=False)

    def forward(self, batch: dict[str, torch.Tensor], step: int = 0, norm: float | None = None):
        """(loss, metrics). The loss is the sum over target tokens (and heads) divided by `norm`:
        the mean target count of the optimizer step's micro-batches (`step_norms`), so that each
        token weighs the same in the step; None divides by this batch's own count (a mean).
        Metrics are (sum, number) pairs: a training log divides them per batch, `evaluate` sums
        them over the held-out split."""
        ids, mask, attn = batch["input_ids"], batch["loss_mask"].bool(), batch["attention_mask"]
        if "hidden" in batch:  # offline: the base's features were computed once
            hidden = original = batch["hidden"].float()
        elif self.lora:  # Medusa-2: gradients flow into the LoRA adapters
            hidden = (
                self.base.get_base_model()
                .model(input_ids=ids, attention_mask=attn)
                .last_hidden_state
            )
            with self.base.disable_adapter():
                original = base_features(self.base, ids, attn)["hidden"]
        else:
            hidden = original = base_features(self.base, ids, attn)["hidden"]
        # Rows whose next token is a target: the base's distribution there is head k's label
        # for position t = row - k - 1.
        next_is_target = shift_left(mask, 1, False)  # (B,T)
        row_of = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
        row_of[next_is_target] = torch.arange(int(next_is_target.sum()), device=ids.device)
        # The original base's distribution: the heads' soft labels, once per batch, on the
        # draft vocabulary (restricted and renormalised = the softmax of its logits there).
        draft_logits, base_top, base_logits = base_targets(
            self.base,
            original[next_is_target],
            self.heads.token_map,
            batch["top"][next_is_target] if "top" in batch else None,
            logits=self.soft,
            full=self.lora,  # Medusa-2's KL term reads the whole distribution
        )  # (n, V_draft) or None, (n,), (n, V) or None
        targets = draft_logits.float().softmax(-1) if self.soft else None  # (n, V_draft)
        n = norm if norm is not None else max(int(next_is_target.sum()), 1)
        del draft_logits  # one (n, V) copy at a time: V is 128k for Llama 3
        metrics: dict[str, tuple] = {}  # (sum, number): a batch's mean, or summed held out
        greedy, kl = base_top, None  # (n,): the token greedy verification accepts at each row
        if self.lora:  # Medusa-2 is served on the adapted base: its greedy token, its KL term
            adapted = output_logits(self.base, hidden[next_is_target]).float().log_softmax(-1)
            greedy = adapted.argmax(-1)
            p = base_logits.float().softmax(-1)
            kl = (p * (p.clamp(min=1e-12).log() - adapted)).sum() / n  # KL(original || adapted)
            del adapted, p
        # A row whose greedy token the draft vocabulary lacks trains nothing, as with hard labels:
        # no draft can propose it, and the rest of the distribution renormalised would teach a
        # token that verification rejects there.
        in_vocab = self.draft_of[greedy] >= 0  # (n,)
        loss = hidden.new_zeros(())
        chain = []  # (B,T) per head: right at that row
        for k in range(len(self.heads.blocks)):
            valid = shift_left(next_is_target, k + 1, False)  # target t+k+2 is an assistant token
            if not valid.any():
                break
            # Heads train in fp32 whatever the base's dtype (a shared lm_head keeps the base's).
            logits = self.heads.head_logits(k, hidden[valid])  # (n_k, V_draft)
            if self.scaling is not None:
                logits = self.scaling(logits)
            rows = shift_left(row_of, k + 1, -1)[valid]
            if targets is not None:
                keep = in_vocab[rows]
                loss_k = soft_target_ce(logits[keep], targets, rows[keep]) / n
            else:
                labels = self.draft_of[shift_left(ids, k + 2)[valid]]
                drafted = labels >= 0  # targets outside a reduced draft vocabulary teach nothing
                losses = nn.functional.cross_entropy(
                    logits.float(), labels.clamp(min=0), reduction="none"
                )
                loss_k = (losses * drafted).sum() / n
            loss = loss + self.decay**k * loss_k
            # Scored against the token greedy verification accepts there, as EAGLE's steps are
            # (sampled answers' own tokens are not the base's choice ~30% of the time here,
            # which read head 0 ~10% lower).
            top = top_ids(logits, 5, self.heads.to_base_ids)  # (n_k, 5) best first
            hits = top == greedy[rows, None]  # (n_k, 5)
            metrics[f"head{k}/top1"] = count(hits[:, 0])
            metrics[f"head{k}/top5"] = count(hits.any(-1))
            ok = torch.zeros(valid.shape, dtype=torch.bool, device=ids.device)
            ok[valid] = hits[:, 0]
            chain.append(ok)
        if kl is not None:
            # The heads' weight ramps up over training; the held-out loss is the full objective
            # (else it would read the heads' part at step 0's weight all through the run).
            ramp = min(1.0, (step + 1) / self.warmup) if self.warmup and self.training else 1.0
            loss = ramp * loss + self.kl_weight * kl
            metrics["kl"] = (float(kl.detach()) * n, int(next_is_target.sum()))  # per token
        metrics["sim_tau"] = sim_tau(chain, next_is_target)
        if not self.training and chain:  # a Python walk over the rows: evaluation only
            # A step starts at row t when its root (t + 1) and first target (t + 2) are answer tokens.
            starts = next_is_target & shift_left(next_is_target, 1, False)
            metrics["walk_tau"] = walk_accept_length(torch.stack(chain), starts)
        return loss, metrics


def build_heads(
    recipe: Recipe, base, train_ds, accelerator, ckpt: Path | None
) -> tuple[MedusaHeads, torch.Tensor | None]:
    """Fresh heads (lm_heads from the base's) and the reduced vocabulary chosen from the data,
    which `begin_run` keeps in OUTPUT/draft_vocab.safetensors for a resumed run to use again
    (None: none, or `training.init_heads`, whose heads' weights and vocabulary are taken)."""
    spec = recipe.heads
    vocab = spec.draft_vocab_size
    cfg = MedusaConfig.from_base(
        base.config,
        num_heads=spec.num_heads,
        num_layers=spec.num_layers,
        original_lm_head=spec.shared_lm_head,
        medusa_fc_bias=spec.fc_bias,
        truncated_vocab_size=vocab,
    )
    with stop_on_bad_input():
        record_training_setup(cfg, recipe)
    token_map, init, built = None, None, None
    if recipe.training.init_heads:  # their weights and reduced vocabulary (token_map)
        init = read_init_heads(recipe, cfg, base)
        token_map = init[0].get("token_map")
    elif vocab is not None:
        with stop_on_bad_input():
            token_map = built = draft_vocabulary(
                train_ds.examples, vocab, base.config.vocab_size, run_folder(ckpt)
            )
    # Every process at once: under ZeRO-3 gathering the lm_head's shards is a collective.
    with (
        gather_for_reading(base.get_output_embeddings().weight),  # its rows start the lm_heads
        stop_on_bad_input(),  # init_heads' own vocabulary or tensors do not fit
    ):
        heads = MedusaHeads(cfg).init_from_base(base, token_map=token_map)
        if init is not None:
            tensors, where = init
            shared = ("lm_head.weight",) if cfg.original_lm_head else ()
            if shared:  # frozen: the base's rows (under the token_map), never the folder's
                tensors.pop("lm_head.weight", None)
            load_state_checked(heads, tensors, where, optional=shared)
            accelerator.print(f"the heads start from {where} (training.init_heads)")
    # Own weights stay fp32 (built so); a shared lm_head stays the base's own tensor.
    return heads.to(device=base.device), built


def training_function(recipe: Recipe) -> dict:
    accelerator = make_accelerator(recipe)
    ckpt = find_resume(recipe, accelerator)
    dtype = base_dtype_for_training(recipe, accelerator, ckpt)
    base, tokenizer = load_frozen_base(recipe, accelerator, dtype)
    with stop_on_bad_input():  # other weights than the checkpoint's
        identity = base_identity(base, ckpt)
    train_ds, eval_ds, data_identity = prepare_data(recipe, base, tokenizer, accelerator, ckpt=ckpt)
    identity |= data_identity
    heads, vocab = build_heads(recipe, base, train_ds, accelerator, ckpt)
    lora_params = []
    if recipe.heads.lora_r > 0:  # Medusa-2 (online: parse_args refuses training.mode=offline)
        from peft import LoraConfig, get_peft_model

        spec = recipe.heads
        base = get_peft_model(
            base,
            LoraConfig(
                r=spec.lora_r,
                lora_alpha=spec.lora_alpha,
                lora_dropout=spec.lora_dropout,
                target_modules=spec.lora_target_modules,
            ),
        )
        lora_params = [p for p in base.parameters() if p.requires_grad]
    model = MedusaTrainee(base, heads, recipe)
    head_params = [p for p in heads.parameters() if p.requires_grad]
    assert_trainable(model, sum(p.numel() for p in head_params + lora_params), accelerator)
    per_epoch, total = count_steps(len(train_ds), recipe, accelerator)
    lr_heads = recipe.training.learning_rate * (
        recipe.heads.heads_lr_multiplier if lora_params else 1.0
    )
    groups = [{"params": head_params, "lr": lr_heads}] + (
        [{"params": lora_params}] if lora_params else []
    )
    optimizer, scheduler = make_optimizer(recipe, groups, total)
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
    bar = tqdm(total=total, initial=step, desc="medusa", disable=not accelerator.is_main_process)
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
                bar.set_postfix(loss=f"{step_loss:.3f}", top1=f"{means.get('head0/top1', 0):.2f}")
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
    trainee = accelerator.unwrap_model(model)
    save_final(recipe, trainee.heads, accelerator, best, base=trainee.base)
    accelerator.end_training()
    return best


def main(argv: list[str] | None = None) -> None:
    run_training(training_function, argv, "medusa")


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        main()
