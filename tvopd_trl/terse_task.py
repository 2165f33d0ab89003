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
"""The real model's task: context distillation of four terse few-shot turns into SmolLM2-135M-Instruct.

Asked a general question, SmolLM2-135M-Instruct answers in at most ten words 17% of the time; after four terse
question/answer turns ("What is the capital of Italy?" "Rome.") it does 83% of the time
(`../shared/real-model-probe/`). The student samples after the bare question (`prompt`) and the same model scores its
answer after the four turns (`teacher_prompt`, `self_distillation`): it learns to answer tersely without them.

The questions are this module's own: general questions made from templates and subjects (`questions`), split by
subject so that no held-out subject is trained on, and a control set of questions with known answers (`FACTS`),
graded by the answer's presence, to see what the student could do before and keeps. Three benchmarks
(`tvopd_trl.eval.BENCHMARKS`):

- ``terse``: the held-out questions, right when the answer has at most `MAX_WORDS` words;
- ``terse-fewshot``: the same after the four turns, the untrained model's score there being the run's reference;
- ``facts``: the control set, right when the answer names the known one (``facts-fewshot``: after the four turns).

``recipes/real/smollm2_terse.yaml`` runs it (`embedded_task: smollm2_terse`).
"""

import dataclasses
import re

from .eval import Benchmark, Problem
from .eval.grading import CORRECT, INCORRECT


MODEL = "smollm2-135m-instruct"  # `tvopd_trl.pretrained`'s name of the student (its own teacher)
MAX_WORDS = 10  # the behaviour: an answer of at most this many words
SHOTS = (
    ("What is the capital of Italy?", "Rome."),
    ("Name a vegetable that is green.", "Broccoli."),
    ("How do I stay warm in winter?", "Wear layers and a warm coat."),
    ("What do fish live in?", "Water."),
)
TOPIC_TEMPLATES = (
    "Tell me something about {}.",
    "What do you know about {}?",
    "Give me a fun fact about {}.",
    "Why do people like {}?",
    "What is special about {}?",
    "How would you explain {} to a child?",
    "What comes to mind when you think of {}?",
    "Where can I find {}?",
)
TOPICS = (
    "volcanoes", "penguins", "bicycles", "libraries", "rainbows", "coffee", "elephants", "the ocean", "honey",
    "clouds", "trains", "chess", "tigers", "the desert", "bread", "owls", "music", "gardens", "snow", "bridges",
    "dolphins", "paper", "the moon", "tomatoes", "castles", "rivers", "kites", "butterflies", "glass", "the piano",
    "sharks", "maps", "candles", "mountains", "cheese", "frogs", "lighthouses", "airplanes", "wolves", "rice",
    "forests", "umbrellas", "whales", "soap", "clocks", "the violin", "pyramids", "spiders", "salt", "storms",
    "islands", "cats", "horses", "tea", "robots", "stars", "apples", "lakes", "museums", "fireworks", "trees", "hats",
    "camels", "bananas", "ants", "windmills", "caves", "diamonds", "chocolate", "rain",
)  # fmt: skip
TASK_TEMPLATES = (
    "How do I {}?",
    "Give me a tip to {}.",
    "What is the best way to {}?",
    "What do I need to {}?",
)
TASKS = (
    "bake bread", "learn to swim", "plant a tree", "fall asleep faster", "save money", "make new friends",
    "study for an exam", "tie a tie", "clean a window", "start running", "write a poem", "learn a language",
    "keep a plant alive", "cook rice", "fix a flat tire", "remember names", "stay focused", "paint a room",
    "wake up early", "take a good photo", "make pancakes", "care for a puppy", "pack for a trip", "drink more water",
    "learn to draw", "play the guitar", "keep calm", "organize my desk", "make a sandwich", "start a journal",
)  # fmt: skip
HELD_OUT_EVERY = 6  # every sixth subject (topic or task) is held out, with all its questions
# The control set: questions with a known answer, each answer's accepted forms separated by "|"
FACTS = (
    ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"), ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of England?", "London"), ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of China?", "Beijing"), ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Greece?", "Athens"), ("What is the capital of Canada?", "Ottawa"),
    ("How many legs does a spider have?", "8|eight"), ("How many legs does a dog have?", "4|four"),
    ("How many days are in a week?", "7|seven"), ("How many months are in a year?", "12|twelve"),
    ("How many hours are in a day?", "24|twenty-four|twenty four"), ("How many sides does a triangle have?", "3|three"),
    ("How many continents are there?", "7|seven"), ("How many wheels does a bicycle have?", "2|two"),
    ("What color is the sky on a clear day?", "blue"), ("What color is grass?", "green"),
    ("What color is snow?", "white"), ("What color is a ripe banana?", "yellow"),
    ("What animal says moo?", "cow"), ("What animal barks?", "dog"), ("What do bees make?", "honey"),
    ("What is frozen water called?", "ice"), ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the red planet?", "Mars"), ("What planet do we live on?", "Earth"),
    ("What star is at the center of our solar system?", "sun"), ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("Who painted the Mona Lisa?", "Leonardo|da Vinci"), ("What is the chemical formula of water?", "H2O"),
    ("What gas do plants take in from the air?", "carbon dioxide|CO2"),
    ("At what temperature in Celsius does water freeze?", "0|zero"),
    ("At what temperature in Celsius does water boil?", "100"), ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the tallest animal?", "giraffe"), ("What is the largest mammal?", "whale"),
    ("What is the opposite of hot?", "cold"), ("What is the opposite of up?", "down"),
    ("What language is spoken in Spain?", "Spanish"), ("What language is spoken in Brazil?", "Portuguese"),
    ("In which country are the pyramids of Giza?", "Egypt"), ("What is 2 plus 2?", "4|four"),
    ("What is 3 times 3?", "9|nine"), ("What do caterpillars turn into?", "butterfly|butterflies|moth"),
    ("Which animal is called the king of the jungle?", "lion"), ("What is a baby dog called?", "puppy|pup"),
    ("What is a baby cat called?", "kitten"), ("What organ pumps blood through the body?", "heart"),
    ("What is the hardest natural substance?", "diamond"),
)  # fmt: skip


def questions(split):
    """The general questions of `split` (`"train"` or `"test"`), in a fixed order: every template of each subject, the
    test split's subjects being every `HELD_OUT_EVERY`-th of the topics and of the tasks."""
    if split not in ("train", "test"):
        raise ValueError(f"The terse task's splits are train and test, not {split!r}.")
    held_out = split == "test"
    return [
        template.format(subject)
        for subjects, templates in ((TOPICS, TOPIC_TEMPLATES), (TASKS, TASK_TEMPLATES))
        for index, subject in enumerate(subjects)
        if (index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out
        for template in templates
    ]


def few_shot_turns():
    """The four terse question/answer turns, as chat messages."""
    return [
        {"role": role, "content": text}
        for question, answer in SHOTS
        for role, text in (("user", question), ("assistant", answer))
    ]


def conversation(question, few_shot):
    """The prompt of `question`: one user turn, after the four terse turns if `few_shot`."""
    return [*(few_shot_turns() if few_shot else []), {"role": "user", "content": question}]


def prompt_dataset(split="train"):
    """A `datasets.Dataset` of `split`'s questions, with the bare `prompt` the student samples after and the few-shot
    `teacher_prompt` its own teacher scores after (`self_distillation`)."""
    from datasets import Dataset

    rows = questions(split)
    return Dataset.from_dict(
        {
            "prompt": [conversation(question, few_shot=False) for question in rows],
            "teacher_prompt": [conversation(question, few_shot=True) for question in rows],
        }
    )


def words(response):
    """The words of a response (whitespace-separated)."""
    return response.split()


def grade_terse(response, gold):
    """(the response, right if it has at most `MAX_WORDS` words); `gold` is unused."""
    text = response.strip()
    return text, CORRECT if 0 < len(words(text)) <= MAX_WORDS else INCORRECT


def grade_presence(response, gold):
    """(the response, right if it names one of `gold`'s "|"-separated forms as a whole word, in any case)."""
    text = response.strip()
    forms = [re.escape(form.strip()) for form in gold.split("|")]
    found = re.search(rf"(?<!\w)({'|'.join(forms)})(?!\w)", text, flags=re.IGNORECASE)
    return text, CORRECT if found else INCORRECT


@dataclasses.dataclass(frozen=True)
class FewShotBenchmark(Benchmark):
    """A benchmark whose every prompt comes after the four terse turns (`few_shot_turns`)."""

    def prompt(self, problem, template=None):
        return [*few_shot_turns(), *super().prompt(problem, template)]


def _facts():
    return [Problem(f"fact-{index}", question, answer) for index, (question, answer) in enumerate(FACTS)]


def _held_out():
    return [Problem(f"terse-{index}", question, str(MAX_WORDS)) for index, question in enumerate(questions("test"))]


def terse_benchmark():
    """``terse``: the held-out questions, graded by `grade_terse`."""
    return Benchmark("terse", "Terse", prompt_template="{problem}", loader=_held_out, grader=grade_terse)


def terse_fewshot_benchmark():
    """``terse-fewshot``: ``terse`` after the four terse turns."""
    return FewShotBenchmark(
        "terse-fewshot", "Terse (few-shot)", prompt_template="{problem}", loader=_held_out, grader=grade_terse
    )


def facts_benchmark():
    """``facts``: the control set (`FACTS`), graded by `grade_presence`."""
    return Benchmark("facts", "Facts", prompt_template="{problem}", loader=_facts, grader=grade_presence)


def facts_fewshot_benchmark():
    """``facts-fewshot``: ``facts`` after the four terse turns, what the teacher knows of the control set."""
    return FewShotBenchmark(
        "facts-fewshot", "Facts (few-shot)", prompt_template="{problem}", loader=_facts, grader=grade_presence
    )
