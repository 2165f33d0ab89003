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

import heapq
import warnings

from transformers import PreTrainedTokenizerBase

# In the evaluation module, the bottom layer, whose generators suppress the same ids
from .eval.generation import padded_token_ids


def check_shared_vocabulary(
    student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase, cross_tokenizer: bool = False
) -> bool:
    """
    Whether both tokenizers map every token, special tokens included, to the same id: sampled-token OPD then scores
    the student's token ids under the teacher. When they do not, raises a `ValueError` that says what differs, unless
    `cross_tokenizer` (the config's) lets the teacher score its own tokenization of the text instead.

    Which special token plays which role may differ (a base model's EOS can be `<|endoftext|>` where its instruct
    teacher's is `<|im_end|>`): only the ids matter, but different EOS tokens get a warning that names the fix.
    """
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    same_vocab = student_vocab == teacher_vocab
    if not same_vocab and cross_tokenizer:
        return False  # all that `cross_tokenizer` needs: listing what differs walks both vocabularies (150k tokens)
    problems = []
    if not same_vocab:
        only_student = student_vocab.keys() - teacher_vocab.keys()
        only_teacher = teacher_vocab.keys() - student_vocab.keys()
        remapped = [t for t in student_vocab.keys() & teacher_vocab.keys() if student_vocab[t] != teacher_vocab[t]]
        problems.append(
            f"vocabularies differ (student {len(student_vocab)} tokens, teacher {len(teacher_vocab)}): "
            f"{len(only_student)} only in the student {heapq.nsmallest(5, only_student)}, {len(only_teacher)} only "
            f"in the teacher {heapq.nsmallest(5, only_teacher)}, {len(remapped)} with different ids "
            f"{heapq.nsmallest(5, remapped)}"
        )
    for name, tokenizer, other_vocab in (("student", student, teacher_vocab), ("teacher", teacher, student_vocab)):
        for token in tokenizer.all_special_tokens:
            if other_vocab.get(token) != tokenizer.convert_tokens_to_ids(token):
                problems.append(
                    f"special token {token!r} of the {name} has id {tokenizer.convert_tokens_to_ids(token)}"
                    f" there but {other_vocab.get(token)} in the other tokenizer"
                )
    if not problems and student.eos_token != teacher.eos_token:
        # A base student beside its instruct teacher: it ends its text where the teacher's turns go on, and a rollout
        # stops at the student's EOS only
        warnings.warn(
            f"The student ends its responses with {student.eos_token!r}, the teacher its turns with "
            f"{teacher.eos_token!r}: a base student before its SFT? Its rollouts stop only at {student.eos_token!r}. "
            f"Fine-tune it first with {teacher.eos_token!r} as its EOS (recipes/qwen3-8b_to_qwen3-8b-sft/sft.yaml: "
            "`eos_token`), or save its tokenizer and generation config with that EOS.",
            stacklevel=3,
        )
    if problems and not cross_tokenizer:
        raise ValueError(
            "The teacher and the student must share one tokenizer, but " + "; ".join(problems) + ". Set "
            "`cross_tokenizer=True` to distill from a teacher of another family on the text spans both tokenizers cut "
            "(docs/cross-tokenizer.md), or use a teacher of the student's family."
        )
    return not problems


def restrict_sampling_to_tokenizer(trainer) -> None:
    """
    Keeps `trainer`'s student from sampling an id its tokenizer does not define.

    Models of one family often pad their output layer beyond the tokenizer (Qwen2.5-7B has 152,064 rows, Qwen2.5-1.5B
    151,936, one tokenizer of 151,665 tokens): teacher and student then share every real token, and sampled-token OPD
    is well defined, as long as no padded id is ever sampled, since the other model's head may lack it. Transformers
    generation suppresses those ids; vLLM gets a logit bias of -100 on each (a few hundred entries per request, where
    `allowed_token_ids` would send and index the whole vocabulary with every request: docs/vllm.md).
    """
    padded = padded_token_ids(trainer.accelerator.unwrap_model(trainer.model), trainer._tokenizer)
    if not padded:
        return
    suppressed = sorted(set(trainer.generation_kwargs.get("suppress_tokens") or []) | set(padded))
    trainer.generation_kwargs["suppress_tokens"] = suppressed
    trainer.generation_config.suppress_tokens = suppressed
    if trainer.use_vllm:
        # A copy: TRL's generation holds the user's own `generation_kwargs` dict, which the config logs and saves
        kwargs = dict(trainer.vllm_generation.generation_kwargs)
        kwargs["logit_bias"] = {**(kwargs.get("logit_bias") or {}), **dict.fromkeys(padded, -100.0)}
        trainer.vllm_generation.generation_kwargs = kwargs
