"""The model card (TRL's mechanism plus a TV-OPD section)."""

from tvopd_trl.eval import BenchmarkEvalCallback, SamplingSettings
from tvopd_trl.model_card import card_section, insert_section
from tvopd_trl.testing import tiny_config


def test_the_card_says_how_the_model_was_trained(make_trainer, model_dirs, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=2, tv_alpha=0.25))
    trainer.add_callback(
        BenchmarkEvalCallback(trainer, ["tiny"], 2, settings=SamplingSettings(k=1, max_new_tokens=8), limit=4)
    )
    trainer.dataset_name = "open-r1/DAPO-Math-17k-Processed"
    trainer.train()
    trainer.create_model_card(model_name="tiny-tvopd")
    card = (tmp_path / "README.md").read_text()
    section = card[card.index("## TV-OPD training") : card.index("### Framework versions")]
    assert "`advantage_mode='tv'` (TV-OPD)" in section
    assert "`tv_alpha=0.25`" in section and "`tv_min_scale=0.1`" in section and "`learning_rate=0.01`" in section
    assert f"Teacher: `{model_dirs['teacher']}`" in section
    assert "Prompts: `open-r1/DAPO-Math-17k-Processed`" in section and "Optimizer steps: 2" in section
    last = next(e for e in reversed(trainer.state.log_history) if "tv/scale" in e)
    assert f"| `tv/scale` | {last['tv/scale']:.4g} | 2 |" in section
    assert f"| `tv/estimate` | {last['tv/estimate']:.4g} | 2 |" in section
    assert "| `eval/tiny/mean@1` |" in section
    # TRL's own parts: the dataset link, the trainer's name and the paper's citation.
    assert "datasets/open-r1/DAPO-Math-17k-Processed" in card and "trained with TV-OPD" in card
    assert "@misc{xiao2026tvopd" in card and "tv-opd" in card.split("---")[1]  # the tag, in the YAML header


def test_card_section_for_a_baseline_and_without_a_marker(tmp_path):
    args = tiny_config(tmp_path, advantage_mode="clip")
    section = card_section(args, [{"step": 3, "tv/scale": 1.0, "tv/estimate": float("nan")}], teacher="t")
    assert "`advantage_mode='clip'` (ClipOPD)." in section and "`advantage_clip_low=-5.0`" in section
    assert "`tv_alpha" not in section and "tv/estimate" not in section  # NaN values are not reported
    assert insert_section("# Card\n", section) == "# Card\n\n" + section


def test_card_section_names_the_task_reward_when_there_is_one(tmp_path):
    plain = card_section(tiny_config(tmp_path), [{"step": 1, "tv/scale": 1.0}])
    assert "reward" not in plain
    args = tiny_config(tmp_path, reward_funcs=["accuracy"], reward_coef=0.5, num_generations=4)
    section = card_section(args, [{"step": 1, "tv/scale": 1.0, "reward": 0.25}])
    assert "`reward_funcs=['accuracy']`" in section and "`reward_coef=0.5`" in section
    assert "`num_generations=4`" in section and "| `reward` | 0.25 | 1 |" in section


def test_a_self_distilled_card_names_the_student_as_its_teacher(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=1, self_distillation="frozen"), teacher_model=None)
    trainer.train()
    trainer.create_model_card(model_name="tiny-self")
    card = (tmp_path / "README.md").read_text()
    assert "Teacher: `the student itself (self_distillation='frozen')`" in card
