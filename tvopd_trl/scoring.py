# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""How the trainer scores completions: the sampled token's log-probability under the student and the teacher (and,
for the modes that need it, the exact per-state divergences), in micro-batch chunks, with the kernel that fits the
device and the sharding."""

import math

import torch
from accelerate.utils import is_peft_model
from trl.trainer.utils import maybe_gather_lm_head_ctx

from .checks import LOGIT_POSTPROCESSING_ATTRIBUTES
from .chunked_logprob import sampled_token_logprobs
from .cross_tokenizer import STATISTICS as ALIGNMENT_STATISTICS
from .divergences import exact_reverse_kl_and_tv
from .packing import pack_rows, token_budget_chunks, unpack_completions
from .spans import align_teacher_logps, token_spans
from .teacher_prompts import teacher_inputs


# A served teacher's request statistics (`TeacherServerPool.last_stats`) and how each pools over processes: the retries
# add up, the step waits for the slowest process, and a replica down for one process is down
SERVED_TEACHER_STATS = {"request_seconds": "max", "retries": "sum", "replicas_down": "max"}
_TEACHER_INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def self_scored_teacher_logps(batch, old_logps) -> torch.Tensor:
    """`batch["teacher_logps"]` with pi_old's `old_logps` on its `self_scored` rows: there the live self-teacher is pi_old
    itself, and its score is pi_old's exactly, not a second forward's rounding of it (padded to the other rows'
    teacher prompts, or on whole rows where the loss runs Ulysses shards)."""
    return torch.where(batch["self_scored"].bool().unsqueeze(1), old_logps, batch["teacher_logps"])


class CompletionScoringMixin:
    """The scoring half of [`TVOPDTrainer`]: it reads the trainer's `args`, `accelerator`, models, `temperature`, the
    served teachers' server pools and TRL's `_forward_redirection` / `_get_last_hidden_state`."""

    def score_completions(self, batch, old_logps=False, exact_divergences=False):
        """
        Adds the per-token signals of a generated batch and returns it.

        Args:
            batch (`dict[str, torch.Tensor]`):
                `prompt_ids`, `prompt_mask`, `completion_ids`, `completion_mask` (and `tool_mask` with tools), as TRL's
                generation returns them.
            old_logps (`bool`, *optional*, defaults to `False`):
                Whether to add `old_logps`, the current student's float32 log-probabilities of the completion tokens.
            exact_divergences (`bool`, *optional*, defaults to `False`):
                Whether to add the exact per-state `reverse_kl` and `exact_tv` over the vocabulary (a local teacher
                only).

        With several teachers, `batch["teacher_index"]` (`(B,)`, see `generate_completions`) routes each row to its
        teacher, which scores it once.

        A teacher with another tokenizer (`cross_tokenizer`) scores its own tokenization of the completion's text,
        after its rendering of the prompt (`teacher_prompt_ids` / `teacher_prompt_mask`, which `generate_completions`
        adds), and the batch gains `span_ids` (`(B, T)`: each token's span in its row, -1 on masked tokens; a span of
        its own for each token of the other rows). With `old_logps`, `teacher_logps - old_logps` is then each span's
        log-ratio delta_span at every token of the span; without, `teacher_logps` holds each span's teacher
        log-probability on its last token and 0 on the others, until the loss knows pi_old
        (`tvopd_trl.spans.align_teacher_logps`).

        Returns:
            `dict[str, torch.Tensor]`: `batch` with `loss_mask` and `teacher_logps` (NaN where a served teacher gave no
            value, or a span is masked), and the signals asked for, all `(B, T)` and 0 at padding.
        """
        batch["loss_mask"] = batch["completion_mask"] * batch.get("tool_mask", 1)
        signals = ["teacher_logps", *(["reverse_kl", "exact_tv"] if exact_divergences else [])]
        served = [teacher for teacher in self.teachers.values() if teacher.served]
        # Per served teacher: whether this process scored on it, then its request statistics (0 where it did not)
        served_stats = torch.zeros(len(served), 1 + len(SERVED_TEACHER_STATS), device=self.accelerator.device)
        # Per teacher of another tokenizer: its alignment statistics on this process
        cross_stats = torch.zeros(len(self.alignments), len(ALIGNMENT_STATISTICS), device=self.accelerator.device)
        with torch.no_grad():
            for teacher, rows, real in self._rows_by_teacher(batch):
                alignment = self.alignments.get(teacher.name)
                if alignment is None:
                    routed = teacher_inputs(batch, rows)  # after each row's teacher prompt, where it has one
                else:
                    aligned = alignment.align_batch(batch, rows, real)
                    routed = aligned.teacher_batch
                    cross_stats[list(self.alignments).index(teacher.name)] = torch.tensor(aligned.statistics())
                if teacher.served:
                    scores = [teacher.client.score(routed, self.temperature).to(self.accelerator.device)]
                    stats = teacher.client.last_stats
                    served_stats[served.index(teacher)] = torch.tensor([1.0, *map(stats.get, SERVED_TEACHER_STATS)])
                else:
                    ids = torch.cat([routed["prompt_ids"], routed["completion_ids"]], dim=1)
                    mask = torch.cat([routed["prompt_mask"], routed["completion_mask"]], dim=1)
                    width = routed["completion_ids"].size(1)
                    with teacher.scoring():  # eval mode, whatever another callback or user did to it since
                        scores = [self._sampled_token_logps(teacher.model, ids, mask, width)]
                    if exact_divergences:
                        student = {key: batch[key][rows] for key in _TEACHER_INPUTS}  # after the student's prompt
                        student_inputs = [
                            torch.cat([student[f"prompt_{k}"], student[f"completion_{k}"]], dim=1)
                            for k in ("ids", "mask")
                        ]
                        with self._whole_rows(), teacher.scoring():  # the student's whole rows
                            divergences = self._exact_divergences(teacher.model, student_inputs, (ids, mask), width)
                        padding = routed["completion_mask"] == 0
                        scores += [divergence.masked_fill(padding, 0.0) for divergence in divergences]
                if alignment is not None:
                    scores = [aligned.student_teacher_logps(scores[0])]
                    if "span_ids" not in batch:
                        batch["span_ids"] = token_spans(batch["loss_mask"])
                    batch["span_ids"][rows[:real]] = aligned.span_ids[:real]
                for name, score in zip(signals, scores, strict=True):
                    if name not in batch:
                        batch[name] = score.new_full(batch["completion_ids"].shape, math.nan)
                    batch[name][rows[:real]] = score[:real]
        if any(teacher.live for teacher in self.teachers.values()):
            self._mark_self_scored(batch)
        if self.alignments:
            # Every process holds `span_ids`, whichever teachers its rows went to
            batch.setdefault("span_ids", token_spans(batch["loss_mask"]))
            self._record_alignment_stats(cross_stats)
        if served:
            self._record_served_teacher_stats(served, served_stats)
        if old_logps:
            self.add_old_logps(batch)
        return batch

    @staticmethod
    def _mark_self_scored(batch):
        """Marks the rows that the live self-teacher scores after the student's own prompt (no teacher prompt of their
        own) in `self_scored` (`(B,)`): the same weights on the same tokens, so their teacher log-probabilities are
        pi_old's, which the loss puts in (`TVOPDTrainer.compute_loss`), and their exact divergences are 0."""
        rows = batch["completion_ids"].size(0)
        own = batch["teacher_prompt_mask"].any(dim=1) if "teacher_prompt_mask" in batch else torch.zeros(rows)
        batch["self_scored"] = (~own.bool()).long()  # integers: gathered over processes, which gloo does for them
        for name in ("reverse_kl", "exact_tv"):
            if name in batch:
                batch[name] = batch[name].masked_fill(batch["self_scored"].bool().unsqueeze(1), 0.0)

    def add_old_logps(self, batch):
        """Adds `old_logps` to a scored batch (see `score_completions`), and aligns a cross-tokenizer teacher's
        `teacher_logps` with them."""
        with torch.no_grad():
            batch["old_logps"] = self._sampled_token_logps(
                self.model,
                torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                batch["completion_ids"].size(1),
            )
        if "span_ids" in batch:
            batch["teacher_logps"] = align_teacher_logps(batch["teacher_logps"], batch["old_logps"], batch["span_ids"])

    def _pool_over_processes(self, stats, reductions):
        """`(teachers, statistics)` `stats` of this process, pooled over all processes by each statistic's reduction
        (`"sum"` or `"max"`): one collective, of one size on every process, whichever teachers each had rows for."""
        gathered = self.accelerator.gather(stats[None])  # (processes, teachers, statistics)
        summed = torch.tensor([reduction == "sum" for reduction in reductions], device=stats.device)
        return torch.where(summed, gathered.sum(dim=0), gathered.amax(dim=0))

    def _record_alignment_stats(self, stats):
        pooled = self._pool_over_processes(stats, ALIGNMENT_STATISTICS.values())
        mode = "train" if self.model.training else "eval"
        for name, values in zip(self.alignments, pooled.tolist(), strict=True):
            spans, student, teacher, largest, masked, scored = values
            if scored == 0:  # no row for this teacher anywhere
                continue
            prefix = "cross_tokenizer/" if len(self.teachers) == 1 else f"cross_tokenizer/{name}/"
            values = {
                "student_tokens_per_span": student / spans if spans else math.nan,
                "teacher_tokens_per_span": teacher / spans if spans else math.nan,
                "max_span_tokens": largest,
                "masked_fraction": masked / scored,
            }
            for metric, value in values.items():
                self.record_metric(prefix + metric, value, mode=mode)

    def _record_served_teacher_stats(self, served, stats):
        # The first column, whether a process scored on the teacher, pools by its maximum
        pooled = self._pool_over_processes(stats, ["max", *SERVED_TEACHER_STATS.values()])
        for teacher, (scored_anywhere, *values) in zip(served, pooled.tolist(), strict=True):
            if not scored_anywhere:  # no process had rows for it: no request was made
                continue
            for stat, value in zip(SERVED_TEACHER_STATS, values, strict=True):
                self.record_metric(
                    f"teacher/{stat}" if len(self.teachers) == 1 else f"teacher/{teacher.name}/{stat}",
                    value,
                    mode="train" if self.model.training else "eval",
                )

    def _rows_by_teacher(self, batch):
        """`(teacher, rows, real)` for each teacher: the indices of its rows in `batch`, of which the first `real` are
        its own. A sharded teacher's forward is a collective, so every process scores as many rows for it as the
        process with the most, repeating row 0 where it has fewer."""
        rows_count = batch["completion_ids"].size(0)
        if len(self.teachers) == 1:
            rows = torch.arange(rows_count, device=batch["completion_ids"].device)
            return [(next(iter(self.teachers.values())), rows, rows_count)]
        if "teacher_index" not in batch:
            raise ValueError(
                f"With several teachers ({', '.join(self.teachers)}), a batch names each row's teacher in "
                "`teacher_index`: generate it with `generate_completions` from prompts with a `teacher_id`."
            )
        index = batch["teacher_index"]
        rows = [(index == k).nonzero().squeeze(1) for k in range(len(self.teachers))]
        real = [len(own) for own in rows]
        if self._shards_models:
            most = self.accelerator.gather(torch.tensor([real], device=index.device)).max(dim=0).values.tolist()
            rows = [
                own if teacher.served else torch.cat([own, own.new_zeros(target - len(own))])
                for own, target, teacher in zip(rows, most, self.teachers.values(), strict=True)
            ]
        return [
            (teacher, own, count)
            for teacher, own, count in zip(self.teachers.values(), rows, real, strict=True)
            if len(own)
        ]

    def _sampled_token_logps(self, model, input_ids, attention_mask, logits_to_keep, with_entropy=False):
        """Float32 `(B, logits_to_keep)` log-probabilities of the completion tokens (0 at padding), scored in the
        forwards of `_row_chunks`, padded or packed (`padding_free`); with `with_entropy`, also the detached entropy of
        each position's distribution, from the same pass."""
        if self._shards_sequences(model):
            return self._sharded_logps(model, input_ids, attention_mask, logits_to_keep, with_entropy)
        with_trl_kernels = self._scores_with_trl_kernels(model, input_ids.device)
        logps, entropies = [], []
        for rows in self._row_chunks(attention_mask, model):
            packed = self._packed_rows(input_ids[rows], attention_mask[rows], logits_to_keep)
            if with_trl_kernels:
                chunk_logps, entropy = self._fused_head_logps(
                    model, input_ids[rows], attention_mask[rows], logits_to_keep, packed, with_entropy
                )
            else:
                unwrapped = self.accelerator.unwrap_model(model)
                # Through the wrapper's forward, so that DDP prepares its gradient reduction for this backward
                chunk_logps, entropy = self._forward_redirection(
                    model,
                    unwrapped,
                    self._completion_logps,
                    unwrapped,
                    input_ids[rows],
                    attention_mask[rows],
                    logits_to_keep,
                    with_entropy,
                    packed,
                )
            logps.append(chunk_logps)
            if with_entropy:
                entropies.append(entropy.detach())
        return (torch.cat(logps), torch.cat(entropies)) if with_entropy else torch.cat(logps)

    def _row_chunks(self, attention_mask, model):
        """The slices of rows that `model` scores in one forward each: `per_device_train_batch_size` rows (the
        activations of one micro-batch), or up to `max_tokens_per_micro_batch` tokens."""
        args = self.args
        rows, budget = attention_mask.size(0), args.max_tokens_per_micro_batch
        if budget is None:
            chunk = args.per_device_train_batch_size
            return [slice(start, start + chunk) for start in range(0, rows, chunk)]
        if args.padding_free:
            lengths = attention_mask.sum(dim=1)
        else:
            lengths = attention_mask.new_full((rows,), attention_mask.size(1))
        chunks = token_budget_chunks(lengths, budget)
        if self._forward_is_collective(model):
            # Every process runs as many forwards as the process that needs the most (each has as many rows for such
            # a model, see `_rows_by_teacher`)
            count = self.accelerator.gather(torch.tensor([len(chunks)], device=attention_mask.device)).max().item()
            chunks = token_budget_chunks(lengths, budget, count=count)
        return chunks

    def _packed_rows(self, input_ids, attention_mask, logits_to_keep):
        # With `padding_free`, the rows of a forward as one sequence of their real tokens; padded as given otherwise
        return pack_rows(input_ids, attention_mask, logits_to_keep) if self.args.padding_free else None

    def _forward_is_collective(self, model):
        # A sharded model's forward gathers its parameters, and DDP's wrapper broadcasts its buffers before each one
        return self._shards_models or isinstance(model, torch.nn.parallel.DistributedDataParallel)

    @property
    def _shards_models(self):
        # The student and the teachers are sharded under FSDP, and under DeepSpeed at ZeRO-3 only: TRL's
        # `prepare_deepspeed` runs a teacher whole (stage 0) below.
        return self.is_fsdp_enabled or (
            self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        )

    def _scores_with_trl_kernels(self, model, device):
        # TRL's fused head is the right kernel where it runs Triton, and the only one that knows every model's logit
        # post-processing, FSDP's DTensors and ZeRO-3. Elsewhere (CPU) `chunked_logprob` projects only the completion
        # positions through one reused tile: half the time and an eighth of the memory (docs/performance.md).
        # `lm_head_precision="model"` needs a float32-output GEMM from bf16 operands, which TRL's head does not do: this
        # module's head runs it on one device or under DDP.
        config = self.accelerator.unwrap_model(model).config.get_text_config()
        return (
            (device.type != "cpu" and self.args.lm_head_precision == "float32")
            or self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or any(getattr(config, name, None) is not None for name in LOGIT_POSTPROCESSING_ATTRIBUTES)
        )

    def _lm_head_dtype(self, weight):
        """The dtype of the LM head's operands: float32, or with `lm_head_precision="model"` the dtype the model
        computes in (autocast's, or its weights')."""
        if self.args.lm_head_precision == "float32":
            return torch.float32
        with self.accelerator.autocast():
            if torch.is_autocast_enabled(weight.device.type):
                return torch.get_autocast_dtype(weight.device.type)
        return weight.dtype

    def _fused_head_logps(self, model, input_ids, attention_mask, logits_to_keep, packed, with_entropy):
        """Through TRL's fused LM head: the log-probabilities (and entropies) of the completion tokens, `(B, T)`."""
        if packed is None:
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, :-logits_to_keep] = -100
            inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        else:
            labels = torch.full_like(packed.input_ids, -100)
            labels[0, packed.predictors + 1] = packed.targets
            inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, labels=labels)
        with self.accelerator.autocast():
            outputs = model(**inputs, fused_lm_head=True)
        scores = [outputs.log_probs, outputs.entropy if with_entropy else None]
        # The head's outputs are 0 where the label is -100, padding included
        if packed is None:
            return [None if x is None else x[:, -logits_to_keep:].float() for x in scores]
        return [None if x is None else unpack_completions(x[0, packed.predictors].float(), packed) for x in scores]

    def _completion_hidden_states(self, unwrapped, input_ids, attention_mask, logits_to_keep, packed=None):
        """The last hidden states that predict the completion tokens: `(B, T, H)`, or, `packed`, `(M, H)` of its
        scored tokens."""
        if packed is None:
            return self._get_last_hidden_state(unwrapped, input_ids, attention_mask, logits_to_keep)
        if is_peft_model(unwrapped):
            unwrapped = unwrapped.base_model.model
        # Without a cache: transformers reads restarting `position_ids` as packed rows only then
        hidden = unwrapped.base_model(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
        ).last_hidden_state
        return hidden[0, packed.predictors]

    def _completion_logps(self, unwrapped, input_ids, attention_mask, logits_to_keep, with_entropy, packed=None):
        with self.accelerator.autocast():
            hidden = self._completion_hidden_states(unwrapped, input_ids, attention_mask, logits_to_keep, packed)
        head = unwrapped.get_output_embeddings()
        with torch.autocast(hidden.device.type, enabled=False):
            scores = sampled_token_logprobs(
                hidden,
                head.weight,
                head.bias,
                input_ids[:, -logits_to_keep:] if packed is None else packed.targets,
                temperature=self.temperature,
                return_entropy=with_entropy,
                compute_dtype=self._lm_head_dtype(head.weight),
            )
        scores = scores if with_entropy else (scores, None)
        if packed is None:
            padding = attention_mask[:, -logits_to_keep:] == 0
            return [None if x is None else x.masked_fill(padding, 0.0) for x in scores]
        return [None if x is None else unpack_completions(x, packed) for x in scores]

    def _exact_divergences(self, teacher_model, student_inputs, teacher_inputs, logits_to_keep):
        """Per completion token, the exact reverse KL and TV between the student after its prompt and the teacher
        after its own (`(input_ids, attention_mask)` each: with a teacher prompt, the teacher's is another)."""
        reverse_kl, tv = [], []
        # The peak stays one forward's, whatever the rollout size; chunked by the wider rows (a teacher prompt's)
        widest = max(student_inputs[1], teacher_inputs[1], key=lambda mask: mask.size(1))
        for rows in self._row_chunks(widest, self.model_wrapped):
            hidden_states, heads = [], []
            for wrapped, (input_ids, attention_mask) in (
                (self.model_wrapped, student_inputs),
                (teacher_model, teacher_inputs),
            ):
                packed = self._packed_rows(input_ids[rows], attention_mask[rows], logits_to_keep)
                unwrapped = self.accelerator.unwrap_model(wrapped)
                # Through the wrapper's forward, so that sharded (ZeRO-3 / FSDP) parameters are gathered for the
                # backbone.
                with self.accelerator.autocast():
                    hidden = self._forward_redirection(
                        wrapped,
                        unwrapped,
                        self._completion_hidden_states,
                        unwrapped,
                        input_ids[rows],
                        attention_mask[rows],
                        logits_to_keep,
                        packed,
                    )
                hidden_states.append(hidden if packed is None else hidden[None])
                heads.append(unwrapped.get_output_embeddings())
            params = [p for head in heads for p in (head.weight, head.bias) if p is not None]
            with maybe_gather_lm_head_ctx(*params):
                chunk_reverse_kl, chunk_tv = exact_reverse_kl_and_tv(
                    *hidden_states, *heads, temperature=self.temperature
                )
            if packed is not None:  # the completions pack alike after either prompt
                chunk_reverse_kl, chunk_tv = (unpack_completions(x[0], packed) for x in (chunk_reverse_kl, chunk_tv))
            reverse_kl.append(chunk_reverse_kl)
            tv.append(chunk_tv)
        return torch.cat(reverse_kl), torch.cat(tv)
