"""The flags users type, held against the list every CLI took at main 31ef74e (its parsers, read once and written
here): a config reshaped into sections keeps them; --help shows each section in a group of its own; and a run's
config.json keeps the keys 31ef74e wrote, so its checkpoints resume."""

import json
import warnings

import pytest
import tyro

from config import BenchConfig, DataCommand, DemoConfig, InferConfig, OpenS2VConfig, TrainConfig, flat_config

CLIS = {"train_a2.py": TrainConfig, "infer.py": InferConfig, "bench.py": BenchConfig, "data.py": DataCommand,
        "demo.py": DemoConfig, "a2.eval.opens2v": OpenS2VConfig}

# every (sub)command's option strings, sorted, as tyro's parser built them at 31ef74e, and those added since on purpose:
# --adam-betas (a recipe can fill the AdamW betas: Kaleido's), data.py index kaleido
FLAGS = {
    "train_a2.py": """
        --adam-betas
        --adam-eps --align-blocks --align-gate-floor --align-gate-power --align-loss --align-model --align-weight
        --attention-backend --cache-dir --checkpoint-fraction --ckpt-every --clip-size --combine --compile --components
        --concatenate-mask --context-parallel --cross-video --data-root --dataset-config --dataset-type --device
        --dry-run --dry-run-ranks --e2v-type --elements --ema-decay --eval-every --eval-manifest --eval-quantiles
        --eval-split --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text --eval.dino --eval.face
        --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb --eval.no-motion-fb --expert
        --fp8-base --fp8-matmul --frame-conditioning --frame-extraction --frame-index --frame-sample --frame-stride
        --fsdp --grad-accum --gradient-checkpointing --help --image-encoder --joint-dropout --keep-last --log-every
        --logit-mean --logit-std --lora-alpha --lora-dropout --lora-rank --lora-target --loss-on-references
        --loss-weighting --lr --lr-schedule --manifest --max-grad-norm --max-memory-gb --max-nonfinite-steps --max-steps
        --memory --micro-batch --mixed-precision --model --no-align-loss --no-concatenate-mask --no-cross-video
        --no-dry-run --no-fp8-base --no-fp8-matmul --no-fsdp --no-gradient-checkpointing --no-loss-on-references
        --no-offload-activations --no-precompute --no-reference-augment --no-save-attention --no-skip-bad-samples
        --no-tensorboard --no-val-metrics --num-frames --num-workers --offload-activations --output-dir
        --overfit-batches --precompute --prefix-frames --reference-augment --reference-dropout --reference-layout
        --reference-timestep --resolution --resume --run-name --sam --sample-mode --save-attention --seed
        --sigma-sampling --sigma-shift --skip-bad-samples --source-fps --swap-blocks --target-fps --tensorboard
        --text-dropout --timestep-buckets --training-type --vace-lora-target --vace-scale --vae-sample-mode
        --val-elements --val-every --val-flow-shift --val-guidance-scale --val-metrics --val-prompt --val-steps
        --warmup-steps --weight-decay -h""",
    "infer.py": """
        --clip-size --combine --compare --components --concatenate-mask --control-video --decode --device --dtype
        --element-specs --elements --eval-set --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text
        --eval.dino --eval.face --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb
        --eval.no-motion-fb --flow-shift --force --fps --frame-conditioning --frame-index --guidance-scale
        --guidance-scale-2 --guidance-scale-img --height --help --image --image-encoder --lora --lora-high --lora-low
        --lora-scale --mask --model --negative-prompt --no-concatenate-mask --no-force --no-side-by-side --num-frames
        --out --out-dir --prefix-frames --preset --prompt --prompts-file --reference-layout --reference-timestep
        --resolution --sample-mode --save-latents --schedule --scheduler --seed --side-by-side --steps --tolerance
        --transformer --transformer-2 --vace-scale --vae-sample-mode --width -h""",
    "bench.py": """
        --align-blocks --align-dim --align-loss --align-refs --attention-backend --batch --check-backends
        --checkpoint-fraction --clips --compare-run --compile --context-parallel --data-root --device --dry-run
        --dry-run-ranks --dtype --ema-decay --fp8-base --fp8-matmul --frames --fsdp --gradient-checkpointing --height
        --help --layout --lora-rank --max-memory-gb --memory --memory-table --micro-batch --mode --no-align-loss
        --no-dry-run --no-fp8-base --no-fp8-matmul --no-fsdp --no-gradient-checkpointing --no-memory-table
        --no-offload-activations --no-save-attention --num-frames --num-workers --offload-activations --opens2v --out
        --peak-tflops --preset --refs --resolution --save-attention --steps --swap-blocks --training-type --warmup
        --width -h""",
    "data.py": """
        --help -h""",
    "data.py make-sample": """
        --height --help --num-frames --num-samples --width -h""",
    "data.py validate": """
        --adam-betas
        --adam-eps --align-blocks --align-gate-floor --align-gate-power --align-loss --align-model --align-weight
        --attention-backend --cache-dir --checkpoint-fraction --ckpt-every --clip-size --combine --compile --components
        --concatenate-mask --context-parallel --cross-video --data-root --dataset-config --dataset-type --device
        --dry-run --dry-run-ranks --e2v-type --elements --ema-decay --eval-every --eval-manifest --eval-quantiles
        --eval-split --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text --eval.dino --eval.face
        --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb --eval.no-motion-fb --expert
        --fp8-base --fp8-matmul --frame-conditioning --frame-extraction --frame-index --frame-sample --frame-stride
        --fsdp --grad-accum --gradient-checkpointing --help --image-encoder --joint-dropout --keep-last --log-every
        --logit-mean --logit-std --lora-alpha --lora-dropout --lora-rank --lora-target --loss-on-references
        --loss-weighting --lr --lr-schedule --manifest --max-grad-norm --max-memory-gb --max-nonfinite-steps --max-steps
        --memory --micro-batch --mixed-precision --model --no-align-loss --no-concatenate-mask --no-cross-video
        --no-dry-run --no-fp8-base --no-fp8-matmul --no-fsdp --no-gradient-checkpointing --no-loss-on-references
        --no-offload-activations --no-precompute --no-reference-augment --no-save-attention --no-skip-bad-samples
        --no-tensorboard --no-val-metrics --num-frames --num-workers --offload-activations --output-dir
        --overfit-batches --precompute --prefix-frames --reference-augment --reference-dropout --reference-layout
        --reference-timestep --resolution --resume --run-name --sam --sample-mode --save-attention --seed
        --sigma-sampling --sigma-shift --skip-bad-samples --source-fps --swap-blocks --target-fps --tensorboard
        --text-dropout --timestep-buckets --training-type --vace-lora-target --vace-scale --vae-sample-mode
        --val-elements --val-every --val-flow-shift --val-guidance-scale --val-metrics --val-prompt --val-steps
        --warmup-steps --weight-decay --world-size -h""",
    "data.py index": """
        --help -h""",
    "data.py index opens2v": """
        --background --cross-pairs --help --min-aes --min-background-aes --min-crop-ratio --min-gme --no-background
        -h""",
    "data.py index phantom": """
        --help --parquet --videos -h""",
    "data.py index humoset": """
        --help -h""",
    "data.py index kaleido": """
        --help -h""",
    "data.py export-elements": """
        --cross-video --help --limit --manifest --no-cross-video --out --sam -h""",
    "demo.py": """
        --clip --elements --frames --guidance-scale --help --out --prompt --seed --steps -h""",
    "a2.eval.opens2v": """
        --device --eval-set --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text --eval.dino --eval.face
        --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb --eval.no-motion-fb --gme-dtype --help
        --json-dir --leaderboard --no-redo --redo --videos -h""",
}


def parser(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: the argparse parser tyro.cli builds
        return tyro.extras.get_parser(cls)


def commands(p, prefix: str):
    """(command, its parser) for a parser and each of its subcommands', depth first."""
    yield prefix, p
    for a in p._actions:
        if type(a).__name__ == "_SubParsersAction":
            for name, sub in a.choices.items():
                yield from commands(sub, f"{prefix} {name}")


def all_commands():
    return {name: p for script, cls in CLIS.items() for name, p in commands(parser(cls), script)}


def test_every_cli_takes_the_same_flags():
    got = {name: sorted(s for a in p._actions for s in a.option_strings) for name, p in all_commands().items()}
    assert got.keys() == FLAGS.keys()
    for name, p in got.items():
        want = FLAGS[name].split()
        assert p == want, f"{name}: lost {sorted(set(want) - set(p))}, new {sorted(set(p) - set(want))}"


@pytest.mark.parametrize("command", FLAGS)
def test_help_groups_are_sections_of_at_most_25(command):
    """--help shows each section under its own title; none is a box of more than 25 options."""
    groups = {g.title: len(g._group_actions) for g in all_commands()[command]._action_groups if g._group_actions}
    assert max(groups.values()) <= 25, groups


# the top-level keys of a run's config.json (and a checkpoint's) as 31ef74e wrote them (a tiny run's, read back):
# a2/train/runs.py compares a resumed run's config with a checkpoint's key by key, so a run dir written before the
# config had sections still resumes; adam_betas is added since (a key a checkpoint lacks is not compared)
CONFIG_JSON_KEYS = """
    adam_betas
    adam_eps align_blocks align_gate_floor align_gate_power align_loss align_model align_weight cache_dir ckpt_every
    clip_size components conditioning context_parallel cross_video data_root dataset_config dataset_type device
    e2v_type elements ema_decay eval eval_every eval_manifest eval_quantiles eval_split expert frame_extraction
    frame_sample frame_stride fsdp grad_accum image_encoder joint_dropout keep_last log_every logit_mean logit_std
    lora_alpha lora_dropout lora_rank lora_target loss_on_references loss_weighting lr lr_schedule manifest
    max_grad_norm max_nonfinite_steps max_steps memory micro_batch mixed_precision model num_frames num_workers
    output_dir overfit_batches precompute reference_augment reference_dropout resolution resume run_name sam seed
    sigma_sampling sigma_shift skip_bad_samples source_fps target_fps tensorboard text_dropout timestep_buckets
    training_type vace_lora_target val_elements val_every val_flow_shift val_guidance_scale val_metrics val_prompt
    val_steps warmup_steps weight_decay"""


def test_a_runs_config_json_keeps_the_flat_layout():
    saved = json.loads(json.dumps(flat_config(TrainConfig(), nested=True)))
    assert sorted(saved) == CONFIG_JSON_KEYS.split()
    assert all(isinstance(saved[k], dict) for k in ("memory", "conditioning", "eval"))


def test_library_functions_take_sections_not_the_whole_config():
    """A function of a2/ takes the sections of TrainConfig it reads (a2/train/step.py the optim, objective and
    references sections, ...), never the whole config: no parameter of a2/ is annotated TrainConfig, and a2/ imports no
    TrainConfig."""
    import ast
    from pathlib import Path

    whole = []
    for path in sorted((Path(__file__).parents[1] / "a2").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "TrainConfig" for a in node.names):
                whole.append(f"{path.name}: imports TrainConfig")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                whole += [f"{path.name}: {node.name}({a.arg})" for a in node.args.args + node.args.kwonlyargs
                          if a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation)]
    assert whole == []
