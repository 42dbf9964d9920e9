"""pdsweep.measure.evaltasks: eval tasks a PD kv_consumer cannot serve (prompt logprobs:
loglikelihood, multiple_choice) are refused at validate; generate_until tasks pass (issue 11)."""

from _sweepfiles import sweep


def test_eval_tasks_needing_prompt_logprobs_are_rejected_at_validate(tmp_path, capsys):
    from pdsweep.cli import main

    sweep(tmp_path, "matrix: {model: [tiny-llama], tp: [p1d1]}\neval: {tasks: [gsm8k, lambada_openai, mmlu_stem]}\n")
    assert main(["validate", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 's.yaml'}: eval.tasks: 'lambada_openai' has output_type loglikelihood: lm-eval sends "
        "echo + logprobs (prompt logprobs), which a PD kv_consumer cannot serve (vLLM issue 50792)"
    ) in err
    assert "'mmlu_stem' (subtask 'mmlu_abstract_algebra') has output_type multiple_choice" in err  # group -> tag
    assert "'gsm8k'" not in err  # generate_until


def test_generate_until_tasks_pass_validate(tmp_path, capsys):
    from pdsweep.cli import main

    sweep(tmp_path, "matrix: {model: [tiny-llama], tp: [p1d1]}\neval: {tasks: [pdsweep_arith]}\n")
    assert main(["validate", str(tmp_path / "s.yaml")]) == 0, capsys.readouterr().err
