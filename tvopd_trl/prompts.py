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
"""Prompt-column adapter: turns a math dataset into the conversational `prompt` column that OPD trains on.

OPD consumes only prompts: the teacher's log-probabilities are the whole supervision signal, so answers, difficulty
labels and reference solutions are dropped (DeepMath-103K's three R1 solutions alone are ~5 GB). The columns kept
beside `prompt` are `teacher_id`, which routes each prompt to its teacher when a run has several
(`tvopd_trl.teachers`), and `teacher_prompt`, what the teachers see instead of the prompt (`tvopd_trl.teacher_prompts`).

The prompt column is used according to what it holds:

- **chat messages** (a list of `{"role", "content"}` dicts), such as DAPO-Math-17K's `prompt` in the original release
  (`BytedTsinghua-SIA/DAPO-Math-17k`), are kept as they are, instruction wrapper included;
- **text**, such as DeepMath-103K's `question` or the bare DAPO problem, becomes one user turn through `template`
  (by default `tvopd_trl.eval.DEFAULT_PROMPT_TEMPLATE`: the problem followed by the `\\boxed{}` instruction that the
  evaluation prompts with, so the student is distilled on the prompt format it is evaluated on).

```python
from datasets import load_dataset
from tvopd_trl.prompts import to_prompt_dataset

prompts = to_prompt_dataset(load_dataset("zwhe99/DeepMath-103K", split="train"), "question")
```
"""

from .eval.benchmarks import DEFAULT_PROMPT_TEMPLATE
from .teachers import TEACHER_ID_COLUMN, TEACHER_PROMPT_COLUMN


# Tried in this order when no column is named: a ready-made chat prompt first, then the usual names of a bare problem.
PROMPT_COLUMNS = ("prompt", "question", "problem")


def resolve_prompt_column(column_names, column=None):
    """The column that holds the prompt: `column` if given, else the first of `PROMPT_COLUMNS` that exists.

    Raises a `ValueError` that lists the dataset's columns when the named column is missing or none is found."""
    column_names = list(column_names)
    if column is not None:
        if column not in column_names:
            raise ValueError(
                f"The dataset has no column {column!r}; its columns are: {', '.join(column_names)}. Set "
                "`dataset_prompt_column` to the one that holds the problem or the chat prompt."
            )
        return column
    found = next((name for name in PROMPT_COLUMNS if name in column_names), None)
    if found is None:
        raise ValueError(
            f"Found no prompt column among the dataset's columns ({', '.join(column_names)}); looked for "
            f"{', '.join(PROMPT_COLUMNS)}. Set `dataset_prompt_column` to the one that holds the problem or the chat "
            "prompt."
        )
    return found


def is_message(message):
    return isinstance(message, dict) and {"role", "content"} <= message.keys()


def to_chat_prompt(value, template=DEFAULT_PROMPT_TEMPLATE):
    """The chat messages for one row: `value` itself if it already is a list of messages, else one user turn that
    poses the text `value` through `template` (`{problem}` marks where it goes; other braces are literal)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("the problem text is empty")
        return [{"role": "user", "content": template.replace("{problem}", value)}]
    if isinstance(value, list) and value and all(is_message(message) for message in value):
        return value
    raise ValueError(
        f"expected a problem text or a list of chat messages with 'role' and 'content', got {type(value).__name__} "
        f"{str(value)[:80]!r}"
    )


def to_prompt_dataset(dataset, column=None, template=DEFAULT_PROMPT_TEMPLATE):
    """`dataset` reduced to one conversational `prompt` column built from `column` (see the module docstring), and
    its `teacher_id` column if it has one.

    `column=None` picks the first of `PROMPT_COLUMNS` that exists. A missing column, or a row that holds neither text
    nor chat messages, raises a `ValueError` that names it; both happen before any model is loaded."""
    if "{problem}" not in template:
        raise ValueError(f"The prompt template must contain '{{problem}}', got {template!r}.")
    if dataset.column_names is None:  # an IterableDataset whose features are unknown until it is read
        if column is None:
            raise ValueError("The dataset's columns are unknown (streaming): set `dataset_prompt_column`.")
    else:
        column = resolve_prompt_column(dataset.column_names, column)

    def convert(row, index):
        try:
            return {"prompt": to_chat_prompt(row[column], template)}
        except ValueError as error:
            raise ValueError(f"Row {index} of column {column!r}: {error}.") from None

    # Selecting first means the map reads one column, not every solution the dataset carries.
    kept = [
        name
        for name in (TEACHER_ID_COLUMN, TEACHER_PROMPT_COLUMN)
        if name in (dataset.column_names or ()) and column != name
    ]
    dataset = dataset.select_columns([column, *kept])
    return dataset.map(convert, with_indices=True, remove_columns=[column])
