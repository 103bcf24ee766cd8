"""Run every benchmark and write its table (benchmarks/results/README.md, docs/benchmarks.md's end).

    python benchmarks/run_all.py [--skip-slow]
    python benchmarks/run_all.py --table-only   # the table again from the JSON results, nothing run

Each benchmark runs in its own process (8 simulated CPU devices; MFU on the GPU when one is
there) and writes its JSON result;
the table is then built from the JSON files only, so every figure in it comes from a run.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs" / "benchmarks.md"
TABLE_HEADING = "## The table\n\n"


# benchmark 20's row of shardax 0.1's default run, measured from that checkout (--source its src/)
GPT_PRESETS = "0.1 presets (layer norm, GELU)"


def run(args):
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=HERE.parent)


def has_gpu() -> bool:
    probe = "import jax; print(jax.devices()[0].platform)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return found.stdout.strip() == "gpu"


def load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def mb(value):
    return f"{value / 1e6:.2f} MB"


def gpu_decisions_rows(decisions: dict | None) -> list[str]:
    """Benchmark 24: each group of the step's choices timed on a GPU, one row per group."""
    if not decisions:
        return []
    lines = []
    for key, rows in decisions.items():
        if not isinstance(rows, dict):
            continue
        parts = [f"{label}: " + (f"{row['step_ms']:.1f} ms, MFU {100 * row['mfu']:.1f}%, "
                                 f"{row['compiled_peak_bytes'] / 1e9:.1f} GB" if "error" not in row
                                 else "out of memory" if "RESOURCE_EXHAUSTED" in row["error"]
                                 else row["error"])
                 for label, row in rows.items()]
        lines.append(f"| 24. The step's choices timed on one {decisions['machine']}, `{key}`, dp, bf16 "
                     f"(median of {decisions['steps']} steps; compiled peak) | {'; '.join(parts)} | "
                     f"keep what is faster |")
    return lines


def _aborts(stress: dict) -> str:
    """Benchmark 25's cell: each command's aborts in XLA's default pool vs shardax's."""
    by_command: dict[str, list[str]] = {}
    for key, row in stress["summary"].items():
        command, pool = key.split(" | ")
        by_command.setdefault(command, []).append(f"{row['aborts']} of {row['runs']} ({pool})")
    return "; ".join(f"{command}: {' vs '.join(counts)}" for command, counts in by_command.items())


def experts_rows(experts: dict | None) -> list[str]:
    if not experts:
        return []
    model, rows = experts["model"], experts["strategies"]
    cells = "; ".join(f"{name} on {row['mesh']}: {row['experts_held_per_device']:g} experts' bytes a device, "
                      f"all-to-all {mb(row['all_to_all_bytes_compiled'])} ("
                      + (f"{row['all_to_all_vs_theory']:.3f}x theory" if row["all_to_all_vs_theory"]
                         else "none")
                      + f"), step {row['step_s']:.2f} s ({row['step_time_vs_dp']:.2f}x dp's)"
                      for name, row in rows.items())
    return [f"| 27. a mixture of {model['n_experts']} experts ({model['experts_per_token']} per token), "
            f"Mixtral-style {model['d_model']}-wide, {model['n_layers']} layers, batch {experts['batch']} x "
            f"{model['seq_len']}, {experts['machine']}: experts held per device, compiled all-to-all bytes "
            f"per device and step / theory, step time (median of interleaved steps) | {cells} | E / X "
            f"experts a device; 1.000x theory |"]


def user_experts_rows(found: dict | None) -> list[str]:
    if not found:
        return []
    model = found["model"]
    cells = "; ".join(f"{row['strategy']} on {row['mesh']}: experts {mb(row['experts_bytes_per_chip'])} of "
                      f"{mb(row['experts_bytes_total'])} a chip, peak {row['peak_bytes_per_chip'] / 1e9:.3f} "
                      f"GB, all-to-all {mb(row['all_to_all_bytes'])}, expert weights gathered "
                      f"{mb(row['expert_weight_gather_bytes'])}" for row in found["rows"])
    return [f"| 28. a user's own Switch-style mixture (stacked expert weights, one-hot dispatch, no "
            f"annotations), {model['EXPERTS']} experts ({model['TOP_K']} per token), "
            f"{model['D_MODEL']}-wide, {model['LAYERS']} layers, batch {found['batch']} x {found['length']}, "
            f"compiled by XLA:TPU for {found['target']}: the experts' dimension read off the program | "
            f"{cells} | 1 / X of the experts a chip; tokens travel (all-to-all), weights do not |"]


def plan_init_from_rows(found: dict | None) -> list[str]:
    if not found:
        return []
    cells = "; ".join(f"{row['target']} {'LoRA ' + str(row['lora_rank']) if row['lora_rank'] else 'full'}: "
                      f"{row['compiled_bytes_per_device'] / 2**30:.2f} GiB a device "
                      f"({'fits' if row['fits'] else 'does not fit'}), "
                      f"analytic {row['predicted_vs_compiled']:.3f}x, "
                      f"roofline {row['step_ms']:.0f} ms, MFU {100 * row['mfu']:.1f}%"
                      for row in found["rows"])
    return [f"| 29. `shardax plan --init-from` a {found['model']} (no weights), fsdp, "
            f"{' '.join(found['flags'][2:-1])}: compiled memory per device, shardax's analytic peak / the "
            f"compiled one, roofline step and MFU | {cells} | analytic within 5% |"]


def post_training_rows(found: dict | None) -> list[str]:
    if not found:
        return []
    rate, epoch, steps = found["learned_tokens_per_s"], found["epoch_s"], found["step_s"]
    ratios = found["dpo_vs_sft"]
    return [f"| 30. SFT on python-chats ({found['conversations']} conversations, bytes), LoRA 8, dp on 8 "
            f"devices, {found['rows']} rows of {found['row_tokens']} a step ({found['machine']}): assistant "
            f"tokens learned a second and an epoch's time, packed / one a row | {rate['packed']:,.0f} / "
            f"{rate['unpacked']:,.0f} tokens/s ({found['packed_vs_unpacked']:.2f}x); epoch "
            f"{epoch['packed']:.0f} / {epoch['unpacked']:.0f} s ({found['epoch_rows']['packed']} / "
            f"{found['epoch_rows']['unpacked']} rows) | packed faster |",
            f"| 30. DPO step, {found['pairs']} pairs ({2 * found['pairs']} rows), against the SFT step of "
            f"{found['rows']} rows: the base weights as reference / its log-probabilities given | "
            f"{ratios['dpo_base_reference']:.2f}x / {ratios['dpo_given_reference']:.2f}x "
            f"({1000 * steps['dpo_base_reference']:.0f} / {1000 * steps['dpo_given_reference']:.0f} vs "
            f"{1000 * steps['sft_unpacked']:.0f} ms) | one more forward, about 1.33x; given: 1x |"]


def overhead_rows(overhead: dict | None) -> list[str]:
    if not overhead:
        return []
    spread = overhead.get("ratio_quartiles")
    spread = f"quartiles {spread[0]:.3f} to {spread[1]:.3f}; " if spread else ""
    return [(f"| 1. step time vs the same step hand-written with `jax.jit` and optax (tiny, dp, 8 "
             f"devices; median of interleaved pairs) | {overhead['ratio']:.3f}x ({spread}"
             f"{1000 * overhead['shardax_step_s']:.0f} vs "
             f"{1000 * overhead['hand_written_step_s']:.0f} ms) | <= 1.03 |")]


def memory_and_communication_rows(comm: dict | None) -> list[str]:
    if not comm:
        return []
    lines = []
    for row in comm["strategies"]:
        lines.append(f"| 2./3. {row['strategy']} on {row['mesh']}: compiled/predicted state, peak (remat "
                     f"none; full), communication compiled/theory | {row['memory_ratio']:.4f}, "
                     f"{row['peak_ratio']:.3f} ({mb(row['peak_bytes_compiled'])}); "
                     f"{row['remat_full_peak_ratio']:.3f} ({mb(row['remat_full_peak_bytes_compiled'])}), "
                     f"{row['communication_ratio']:.3f} ({mb(row['collective_bytes'])} vs "
                     f"{mb(row['theoretical_collective_bytes'])}) | 1 +- 0.02, 1 +- 0.05, <= 1.05 |")
    return lines


def compile_time_rows(compile_: dict | None) -> list[str]:
    if not compile_:
        return []
    seconds = compile_["seconds"]
    return [(f"| 4. compile time, 32 layers / 4 layers (scan; median of {compile_.get('rounds', 1)} "
             f"paired fresh compiles, order alternating, after a warm-up) | {compile_['ratio']:.2f}x "
             f"({seconds['32']:.1f} s vs {seconds['4']:.1f} s) | <= 1.5 |")]


def notebook_step_time_rows(notebook: dict | None) -> list[str]:
    if not notebook:
        return []
    spread = notebook.get("tokens_per_s_ratio_quartiles")
    spread = f"quartiles {spread[0]:.3f} to {spread[1]:.3f}; " if spread else ""
    return [(f"| 5. tokens/s, the GPT-style model, blocks in a loop like the notebook's, vs the "
             f"notebook's own code (median of interleaved pairs) | "
             f"{notebook['tokens_per_s_ratio']:.3f}x "
             f"({spread}{notebook['shardax_tokens_per_s']:,.0f} vs "
             f"{notebook['notebook_tokens_per_s']:,.0f} tok/s, the medians) | >= 1.0 |")]


def largest_model_rows(largest: dict | None) -> list[str]:
    if not largest:
        return []
    lines = []
    budget = largest["budget_bytes_per_device"] / 1e9
    for row in largest["strategies"]:
        best = row["largest"]
        text = "none" if not best else (f"{best['parameters'] / 1e6:.0f}M parameters "
                                         f"(d_model {best['d_model']}, {best['n_layers']} layers), "
                                         f"peak {best['peak_bytes'] / 1e9:.2f} GB")
        schedule = f", {row['microbatches']} microbatches" if row.get("microbatches") else ""
        lines.append(f"| 6. largest model under {budget:.0f} GB/device, {row['strategy']} on "
                     f"{row['mesh']}{schedule} | {text} | - |")
    return lines


def pipeline_bubble_rows(bubble: dict | None) -> list[str]:
    if not bubble:
        return []
    lines = []
    for case in bubble["cases"]:
        circular = f", {case['repeats']} repeats" if case["repeats"] > 1 else ""
        lines.append(f"| 11. pipeline bubble on {bubble['mesh']}, M = {case['microbatches']}{circular}: "
                     f"idle stage iterations of the compiled loops ({case['compiled_iterations']} run) | "
                     f"{100 * case['bubble_compiled']:.1f}% (formula "
                     f"{100 * case['bubble_formula']:.1f}%) | = formula |")
    return lines


def pipeline_vmap_rows(vmaps: dict | None) -> list[str]:
    if not vmaps:
        return []
    ratio, median = vmaps["nnx_over_jax"], vmaps["median"]["jax.vmap"]
    same = ("the same program and loss" if vmaps["same_loss"] and ratio["stablehlo_chars"] == 1
            else "DIFFERENT programs")
    return [(f"| 11. stages applied by `nnx.vmap` / by `jax.vmap` (shardax's), one pp step on "
             f"{vmaps['mesh']}, {vmaps['model']['n_layers']} layers of d_model "
             f"{vmaps['model']['d_model']}, median of {vmaps['rounds']} fresh compiles each | "
             f"{same}; compile {ratio['compile_s']:.2f}x ({median['compile_s']:.1f} s), peak host "
             f"memory while compiling {ratio['peak_rss_growth_mb']:.2f}x "
             f"({median['peak_rss_growth_mb']:.0f} MB), temporaries {ratio['temp_bytes']:.2f}x | "
             f"measured before choosing |")]


def longest_sequence_rows(longest: dict | None) -> list[str]:
    if not longest:
        return []
    lines = []
    budget = longest["budget_bytes_per_device"] / 1e9
    rows = longest["rows"]
    text = "; ".join(f"C={r['context']} {r['attention']}: {r['longest_tokens']:,} tokens"
                     + (f" ({r['ratio_to_one_device']:.1f}x)" if "ratio_to_one_device" in r else "")
                     for r in rows)
    lines.append(f"| 12. longest sequence under {budget:.0f} GB/device, `{longest['preset']}`, one "
                 f"sequence per step, context axis of C | {text} | >= 6x |")
    for row in longest["communication"]:
        lines.append(f"| 12. communication per step, C=8 {row['attention']}, {row['seq_len']} tokens: "
                     f"compiled / theory | {row['compiled_over_theory']:.3f} "
                     f"({row['compiled_bytes'] / 1e6:.0f} MB) | 1 +- 0.05 |")
    return lines


def plan_accuracy_rows(accuracy: dict | None) -> list[str]:
    if not accuracy:
        return []
    lines = []
    for case, (low, high) in accuracy["predicted_over_compiled_peak"].items():
        lines.append(f"| 2. plan's peak, predicted/compiled: {case} | {low:.3f} to "
                     f"{high:.3f} | 1 +- 0.05 |")
    return lines


def plan_held_out_rows(held_out: dict | None) -> list[str]:
    if not held_out:
        return []
    lines = []
    groups: dict[tuple[bool, str], list[float]] = {}
    for case in held_out["cases"]:
        kind = ("blocks in a loop" if case.get("scan_layers") is False
                else f"remat {case.get('remat', 'none')}")
        groups.setdefault((case.get("large_rows", False), kind), []).append(case["peak_ratio"])
    for (large, kind), ratios in sorted(groups.items(), key=lambda item: item[0][0]):
        worst = max(abs(r - 1) for r in ratios)
        many = len(ratios) // (3 if large else 7)
        how = ("many rows per device: dp on data=1, fsdp on data=2, tp on data=2,model=4 "
               "with twice the batch"
               if large else "7 strategies")
        lines.append(f"| 2. plan's peak, predicted/compiled (XLA:CPU), shapes never fitted on, {kind}: "
                     f"{many} shape{'s' if many > 1 else ''} x {how} | {min(ratios):.3f} to "
                     f"{max(ratios):.3f} (worst {100 * worst:.1f}%, median "
                     f"{100 * statistics.median(abs(r - 1) for r in ratios):.1f}%) | 1 +- 0.05 |")
    return lines


def trainer_overhead_rows(trainer: dict | None) -> list[str]:
    if not trainer:
        return []
    lines = []
    for case in trainer["cases"]:
        low, high = case["ratio_quartiles"]
        lines.append(f"| 8. `Trainer` step time / a hand-written loop calling the same jitted step, "
                     f"{case['case']} | {case['ratio']:.3f} (quartiles {low:.3f} to {high:.3f}; "
                     f"{1000 * case['trainer_step_s']:.1f} vs "
                     f"{1000 * case['hand_written_step_s']:.1f} ms) | <= 1.02 |")
    return lines


def lm_data_rows(data: dict | None) -> list[str]:
    if not data:
        return []
    lines = []
    lines.append(f"| 9. `shardax prepare` throughput, {data['text_bytes'] / 1e6:.0f} MB of stdlib-made "
                 f"JSON lines, {data['cores']} cores: bytes; BPE 4096 (training included) | "
                 f"{data['prepare_bytes_mb_per_s']:.1f} MB/s; "
                 f"{data['prepare_bpe_mb_per_s']:.1f} MB/s | - |")
    loading = data["loading"]
    lines.append(f"| 9. data loading / step time, `tiny` on the byte shards (dp, 8 devices): the batch "
                 f"function alone; the loop reading shards / the same loop reusing one batch "
                 f"(interleaved) | {100 * data['loading_fraction']:.2f}% "
                 f"({1000 * loading['batch_fn_alone_s']:.2f} of "
                 f"{1000 * loading['step_s_fixed_batch']:.0f} ms); {loading['ratio']:.3f}x | <= 2% |")
    lines.append(f"| 9. peak resident memory of `shardax train`, {data['shards_large_bytes'] / 1e9:.2f} "
                 f"GB vs {data['shards_small_bytes'] / 1e9:.2f} GB of shards | "
                 f"{data['peak_rss_ratio']:.3f} ({data['peak_rss_large_bytes'] / 1e6:.0f} vs "
                 f"{data['peak_rss_small_bytes'] / 1e6:.0f} MB) | 1 +- 0.10 |")
    return lines


def bpe_vs_bytes_rows(versus: dict | None) -> list[str]:
    if not versus:
        return []
    return [(f"| 10. validation bits per byte after {versus['steps']} steps of `{versus['preset']}` "
             f"on the stdlib: BPE {versus['vocab_size']} vs bytes (same held-out documents) | "
             f"{versus['bpe']['val_bits_per_byte']:.3f} vs "
             f"{versus['bytes']['val_bits_per_byte']:.3f} "
             f"({versus['bits_per_byte_ratio']:.3f}x) | < 1 |")]


def layer_vjps_rows(vjps: dict | None) -> list[str]:
    if not vjps:
        return []
    low, high = vjps["speedup_quartiles"]
    memory = "; ".join(f"{preset} {peaks['custom'] / 1e9:.2f} vs {peaks['autodiff'] / 1e9:.2f} GB"
                       for preset, peaks in vjps["memory_only"].items())
    return [(f"| 13. layer norm and GELU with custom VJPs / plain autodiff ({vjps['machine']}; "
             f"dp on {vjps['mesh']}, {vjps['compute_dtype']}): "
             f"step time of `{vjps['preset']}` (median of interleaved pairs); compiled peak per "
             f"device | {vjps['speedup']:.3f}x faster (quartiles {low:.3f} to {high:.3f}; "
             f"{1000 * vjps['custom_step_s']:.0f} vs {1000 * vjps['autodiff_step_s']:.0f} ms); "
             f"{vjps['custom_peak_bytes'] / 1e9:.3f} vs {vjps['autodiff_peak_bytes'] / 1e9:.3f} "
             f"GB; {memory} | >= 1.0, less memory |")]


def gpu_checks_rows(gpu: dict | None) -> list[str]:
    if not gpu:
        return []
    lines = []
    for case in gpu.get("cudnn_attention", {}).get("cases", []):
        lines.append(f"| 14. cuDNN attention in the model, `small` in bf16, {case['batch']} "
                     f"({gpu['machine']}): worst gradient error vs fp32, cuDNN / XLA bf16 | "
                     f"{case['cudnn']['worst_gradient_error']:.2e} / "
                     f"{case['xla']['worst_gradient_error']:.2e} "
                     f"({'passes' if case['passes'] else 'FAILS'}) | <= 1.5x XLA's |")
    plan = gpu.get("plan")
    if plan and plan["ratio_range"]:
        low, high = plan["ratio_range"]
        lines.append(f"| 14. plan's peak, predicted/compiled on the GPU ({gpu['machine']}), dp on one "
                     f"device in float32, presets and held-out shapes | {low:.3f} to {high:.3f} (worst "
                     f"{100 * plan['worst_abs_error']:.1f}%) | XLA:CPU estimate |")
    return lines


def checkpoint_integrity_rows(integrity: dict | None) -> list[str]:
    if not integrity:
        return []
    lines = []
    for row in integrity["rows"]:
        two = row["check_over_processes"]
        lines.append(
            f"| 15. checkpoint of {row['checkpoint_bytes'] / 1e6:.0f} MB, one process "
            f"({integrity['machine']}): `save` blocks; committed after; of which hashing; checking at "
            f"resume, blocks on {row['check_threads']} threads / whole files on one; over 2 processes / "
            f"1 (one thread each) | {1000 * row['save_blocks_s']:.0f} ms; {row['committed_after_s']:.2f} "
            f"s; {row['sealing_hash_s']:.2f} s; {row['check_shared_blocks_s']:.2f} / "
            f"{row['check_whole_files_one_thread_s']:.2f} s; {two['2']['wall_s']:.2f} / "
            f"{two['1']['wall_s']:.2f} s | hashing off the loop; checking shared |")
    return lines


def fault_battery_rows(battery: dict | None) -> list[str]:
    if not battery:
        return []
    return [(f"| 16. fault battery (`benchmarks/fault_battery.py`): kills, damaged checkpoints, a "
             f"full disk, signals, two runs in one directory, damaged data, `launch` | "
             f"{battery['passed']} of {battery['cases']} cases pass; {battery['lost_checkpoints']} "
             f"committed checkpoints lost | all; 0 |")]


def hf_load_rows(loading: dict | None) -> list[str]:
    if not loading or "warm_float32" not in loading:
        return []

    def held_as(dtype: str) -> str:
        warm = loading[f"warm_{dtype}"]
        speeds = "; ".join(f"{cache} {run['load_gb_per_s']:.2f} / {run['raw_gb_per_s']:.2f} GB/s"
                           for cache in loading["caches"] for run in [loading[f"{cache}_{dtype}"]])
        return (f"as {dtype}: {warm['added_over_largest_tensor']:.2f} "
                f"({warm['added_rss_bytes'] / 1e6:.0f} MB); {speeds}")

    return [(f"| 17. loading a Hugging Face checkpoint of {loading['parameters'] / 1e9:.2f}B "
             f"parameters ({loading['files_bytes'] / 1e9:.2f} GB of bf16 safetensors) FSDP over 8 "
             f"CPU devices: host memory the loader adds beyond the loaded state, in largest tensors "
             f"of the loaded dtype; load / raw read throughput from a "
             f"{' and a '.join(loading['caches'])} page cache (medians of {loading['repeats']}, "
             f"alternating) | {held_as('float32')}; {held_as('bfloat16')} | <= 2 tensors; "
             f"load >= 1/2 of raw |")]


def lora_rows(lora: dict | None) -> list[str]:
    if not lora:
        return []
    full, low = lora["full"], lora["lora"]
    return [(f"| 18. LoRA rank {lora['rank']} (all 7 projections) / full fine-tuning, "
             f"{lora['parameters'] / 1e6:.1f}M parameters, {lora['strategy']} on {lora['mesh']} "
             f"({lora['machine']}): optimizer state per device; step time (median of interleaved "
             f"steps); compiled scratch per device | {mb(low['optimizer_bytes_per_device'])} / "
             f"{mb(full['optimizer_bytes_per_device'])} "
             f"({100 * lora['optimizer_bytes_ratio']:.1f}%); {low['step_s']:.2f} / "
             f"{full['step_s']:.2f} s ({lora['step_time_ratio']:.2f}x); "
             f"{mb(low['compiled_temp_bytes_per_device'])} / "
             f"{mb(full['compiled_temp_bytes_per_device'])} | less |")]


def generation_rows(generation: dict | None) -> list[str]:
    if not generation:
        return []
    speed = "; ".join(f"{row['new_tokens']}: {row['cache_tokens_per_s']:.0f} vs "
                      f"{row['recompute_tokens_per_s']:.1f} tok/s ({row['speedup']:.1f}x)"
                      for row in generation["rows"] if "speedup" in row)
    flat = ", ".join(f"{row['model']} {row['step_vs_128']:.2f}x ({row['step_ms']:.1f} ms; bytes "
                     f"{row['bytes_vs_128']:.2f}x)" for row in generation["rows"] if "step_vs_128" in row)
    cache, ring = generation["cache"], generation.get("ring")
    ringed = ("" if ring is None else
              f"; window 256 on alternate layers at {ring['new_tokens']:,} new tokens: "
              f"{ring['ratio']:.3f} of theory ({mb(ring['bytes_per_device'])}), "
              f"{ring['of_grown_whole']:.3f} of a cache grown whole")
    return [(f"| 19. decoding with the key/value cache, {generation['model']}, one prompt on one CPU "
             f"device ({generation['machine']}), greedy: tokens/s with the cache vs recomputing the "
             f"prefix (same tokens), by new tokens; the decode step's time (median of the last 64) "
             f"at 2,048 new tokens / at 128, beside the ratio of the bytes a step reads (weights, "
             f"keys and values); the cache's bytes per device while decoding, {cache['batch']} rows "
             f"on {cache['mesh']}, / 2 B kv_heads head_dim (L T, or the windowed layers at their "
             f"ring) bytes / devices | {speed}; {flat}; {cache['ratio']:.3f} "
             f"({mb(cache['bytes_per_device'])}){ringed} | >= 10x at 512; <= 1.5x; 1 |")]


def default_sample_rows(found: list | None) -> list[str]:
    sample = {row["label"]: row for row in found or []}
    if "before" not in sample or "after" not in sample:
        return []
    before, after = sample["before"], sample["after"]

    def setting(row):
        return (f"{'BPE of ' + str(row['vocab']) + ' tokens' if row['tokenizer'] else 'bytes'}, batch "
                f"{row['batch_size']} x {row['steps']} steps, temperature {row['temperature']:g}, "
                f"top-k {row['top_k']}")

    def measured(row):
        return (f"{100 * row['word_share']:.1f}% "
                f"({100 * row['lowest']:.0f}-{100 * row['highest']:.0f}%), {row['wall_s']:.0f} s")

    gpt = sample.get(GPT_PRESETS)
    return [(f"| 20. the default `shardax train`: share of its samples' words found in the corpus (8 "
             f"samples of 200 tokens, pooled; single samples' range) and seconds to the end of "
             f"training from an empty data cache ({after['machine']}): before ({setting(before)}) / "
             + (f"{GPT_PRESETS} / " if gpt else "")
             + f"after ({setting(after)}, Llama-shaped tiny) | "
               f"{measured(before)} / "
             + (f"{measured(gpt)}, validation {gpt['val_loss']:.3f} / " if gpt else "")
             + f"{measured(after)}, validation {after['val_loss']:.3f} nats/token | more "
               f"real words, about 90 s |")]


def simulated_stress_rows(stress: dict | None, first: dict | None) -> list[str]:
    if not stress:
        return []
    cells = _aborts(stress)
    if first:
        cells += f"; before RMSNorm and SwiGLU had their own backward passes: {_aborts(first)}"
    return [(f"| 25. runs aborted in XLA:CPU's collectives, {stress['devices']} simulated devices "
             f"beside a load of {stress['load processes']} busy processes on {stress['cores']} "
             f"cores, XLA's default thread pool vs shardax's (`simulate_cpu_devices`) | {cells} "
             f"| 0 with shardax's |")]


def ema_rows(ema: dict | None) -> list[str]:
    if not ema:
        return []
    cells = "; ".join(f"{strategy}: {row['ema_bytes_ratio']:.3f}x the parameters' bytes, step "
                      f"{row['step_time_ratio']:.3f}x ({row['step_s_with'] * 1e3:.1f} vs "
                      f"{row['step_s_without'] * 1e3:.1f} ms)"
                      for strategy, row in ema["strategies"].items())
    return [(f"| 26. a moving average of the weights (`ema_params({ema['decay']})`), Llama-style "
             f"{ema['model']['d_model']}-wide, {ema['model']['n_layers']} layers, batch "
             f"{ema['batch']}, on {ema['mesh']}: its bytes per device / the parameters', step time "
             f"with / without (median of interleaved steps) | {cells} | dp 1x, zero2 1/8 (the "
             f"optimizer state's share), fsdp 1x of its share; under 5% a step |")]


def ema_nvidia_h200_rows(ema_gpu: dict | None) -> list[str]:
    if not ema_gpu:
        return []
    row = ema_gpu["strategies"]["dp"]
    return [(f"| 26. the same on {ema_gpu['machine']}: Llama-style "
             f"{ema_gpu['model']['d_model']}-wide, {ema_gpu['model']['n_layers']} layers, vocabulary "
             f"{ema_gpu['model']['vocab_size']} ({row['param_bytes_per_device'] / 4e9:.2f}B "
             f"parameters), batch {ema_gpu['batch']} x {ema_gpu['model']['seq_len']}, bfloat16 "
             f"compute, dp | {row['ema_bytes_ratio']:.3f}x the parameters' bytes, step "
             f"{row['step_time_ratio']:.3f}x ({row['step_s_with'] * 1e3:.1f} vs "
             f"{row['step_s_without'] * 1e3:.1f} ms) | the average's read and "
             f"write, about 1% a step |")]


def pipeline_held_out_rows(pipelines: dict | None, compiler: str) -> list[str]:
    if not pipelines:
        return []
    ratios = [case["peak_ratio"] for case in pipelines["cases"]]
    close = sum(abs(r - 1) <= 0.05 for r in ratios)
    above = [case["peak_ratio"] for case in pipelines["cases"] if case["compiled_peak"] >= 300e6]
    heaps = compiler.startswith("XLA:TPU") and "estimated_peak" in pipelines["cases"][0]
    floor = f"; above 300 MB a chip: {', '.join(f'{r:.3f}' for r in above)}" if heaps else ""
    heap = " heap-based" if heaps else ""
    return [(f"| 2. plan's peak, predicted/compiled{heap} ({compiler}), pipeline steps never "
             f"worked out on: {len(ratios)} shapes x pp/pp_fsdp/pp_tp, microbatches, a circular "
             f"schedule | {min(ratios):.3f} to {max(ratios):.3f} ({close} of {len(ratios)} "
             f"within 5%{floor}) | 1 +- 0.05 |")]


def tpu_plan_rows(found: dict | None) -> list[str]:
    lines = []
    for key, entry in (found or {}).items():
        rows = [row for row in entry["rows"] if "peak_gb" in row]

        def span(field, scale=1.0, digits=2):
            values = [scale * row[field] for row in rows if row.get(field)]
            return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if values else "-"

        heaps = all("hbm_peak_gb" in row for row in rows)
        peaks = ", ".join((f"{row['strategy']} {row['hbm_peak_gb']:.2f} ({row['peak_gb']:.2f})" if heaps else
                           f"{row['strategy']} {row['peak_gb']:.2f}") if "peak_gb" in row else
                          f"{row['strategy']} does not fit" for row in entry["rows"])
        lines.append(
            f"| 21. {key} (batch {entry['batch_size']} x {entry['seq_len']}) compiled by XLA:TPU on this CPU "
            f"host, {'every strategy' if len(entry['rows']) >= 10 else 'strategies that spread a 1b model'}: "
            f"GB per chip{' as XLA:TPU allocates it (its memory analysis in brackets)' if heaps else ''}; "
            f"collectives sent vs theory; XLA FLOPs vs 6 N tokens + "
            f"attention; roofline MFU (upper bound); shardax's analytic peak vs XLA:TPU's"
            f"{' heap-based one' if heaps else ''} | {peaks}; "
            f"{span('sent_vs_theory')}x; {span('flops_vs_model', digits=3)}x; {span('mfu', 100, 1)}%; "
            f"{span('predicted_vs_compiled')}x | all fit; within 5% of theory; ~1; -; within 5% above "
            f"300 MB a chip |")
    return lines


def tpu_decisions_rows(decisions: dict | None) -> list[str]:
    lines = []
    for key, rows in (decisions or {}).items():
        if "as shipped" not in rows:  # the select against the cond, per strategy
            ratios = [row["select_vs_cond"] for row in rows["rows"]]
            lines.append(f"| 22. {key}, small and a wide shallow model, dp/zero2/fsdp/tp/hsdp: the select's "
                         f"compiled peak vs the cond's | {min(ratios):.2f}-{max(ratios):.2f}x | select on "
                         f"TPUs (pipelines and XLA:CPU keep the cond) |")
            continue
        shipped = rows["as shipped"]
        parts = [f"{name.removeprefix('without ')}: peak {shipped['peak_bytes'] / 1e9:.3f} vs "
                 f"{row['peak_bytes'] / 1e9:.3f} GB, roofline {shipped['step_ms']:.3f} vs "
                 f"{row['step_ms']:.3f} ms"
                 for name, row in rows.items() if name != "as shipped"]
        lines.append(f"| 22. {key}, dp, bfloat16: choices made on XLA:CPU, as shipped vs undone, by "
                     f"XLA:TPU's compile | {'; '.join(parts)} | keep what helps |")
    return lines


def mfu_rows(mfu: dict | None) -> list[str]:
    if not mfu:
        return [("| 7. MFU on one H100/H200 (`benchmarks/mfu.py`) | not measured: no GPU was lent to "
                 "this task | >= 50% |")]
    top = "; ".join(f"{row['jax_op'].split('/')[-1] or row['hlo_op']} {100 * row['share']:.1f}%"
                    for row in mfu.get("top_ops", []))
    others = "; ".join(f"remat {run['remat']}, batch {run['batch_size']}: {100 * run['mfu']:.1f}%"
                       for run in mfu.get("other_runs", []))
    blocks = "scanned" if mfu.get("scan_layers", True) else "in a Python loop"
    return [(f"| 7. MFU on one {mfu['machine']}, `{mfu['preset']}` in bf16, batch "
             f"{mfu['batch_size']}, remat {mfu['remat']}, attention {mfu.get('attention', '?')}, "
             f"blocks {blocks} ({mfu['formula']}) | {100 * mfu['mfu']:.1f}% "
             f"({mfu['tokens_per_s']:,.0f} tok/s, {mfu['model_flops_per_s'] / 1e12:.0f} TFLOP/s, "
             f"peak {mfu['peak_bytes_in_use'] / 1e9:.1f} GB{'; ' + others if others else ''}; top "
             f"ops, none over 6%: {top}) | >= 50% |")]


def h100_aot_rows(aot: dict | None) -> list[str]:
    if not aot:
        return []
    cases = [row for row in aot["cases"] if "real" in row]
    return [(f"| 23. `--target h100-1` (deviceless XLA:GPU) vs the real {aot['machine']}, "
             f"{aot['strategy']}, {len(cases)} shapes (tiny..large): compiled peak, deviceless/real; "
             f"XLA:GPU's own FLOPs / the model's; shardax's analytic peak / XLA:GPU's | "
             f"{min(r['peak_ratio'] for r in cases):.3f}-{max(r['peak_ratio'] for r in cases):.3f}; "
             f"{min(r['flops_ratio'] for r in cases):.4f}-{max(r['flops_ratio'] for r in cases):.3f} "
             f"(cuBLAS and cuDNN calls uncounted); "
             f"{min(r['analytic_peak_ratio'] for r in cases):.2f}-"
             f"{max(r['analytic_peak_ratio'] for r in cases):.2f}x"
             f" | 1; -; - |")]


# (result name, row function) for each benchmark, in the table's order: each function takes the
# result (None when missing) and returns its table lines.
SECTIONS = (
    ("overhead", overhead_rows),
    ("memory_and_communication", memory_and_communication_rows),
    ("compile_time", compile_time_rows),
    ("notebook_step_time", notebook_step_time_rows),
    ("largest_model", largest_model_rows),
    ("pipeline_bubble", pipeline_bubble_rows),
    ("pipeline_vmap", pipeline_vmap_rows),
    ("longest_sequence", longest_sequence_rows),
    ("plan_accuracy", plan_accuracy_rows),
    ("plan_held_out", plan_held_out_rows),
    ("trainer_overhead", trainer_overhead_rows),
    ("lm_data", lm_data_rows),
    ("bpe_vs_bytes", bpe_vs_bytes_rows),
    ("layer_vjps", layer_vjps_rows),
    ("layer_vjps_gpu", layer_vjps_rows),
    ("gpu_checks", gpu_checks_rows),
    ("checkpoint_integrity", checkpoint_integrity_rows),
    ("fault_battery", fault_battery_rows),
    ("hf_load", hf_load_rows),
    ("lora", lora_rows),
    ("generation", generation_rows),
    ("default_sample", default_sample_rows),
    ("simulated_stress", lambda found: simulated_stress_rows(found, load("simulated_stress_first"))),
    ("ema", ema_rows),
    ("ema_nvidia_h200", ema_nvidia_h200_rows),
    ("experts", experts_rows),
    ("user_experts", user_experts_rows),
    ("plan_init_from", plan_init_from_rows),
    ("post_training", post_training_rows),
    ("pipeline_held_out", lambda found: pipeline_held_out_rows(found, "XLA:CPU")),
    ("pipeline_held_out_tpu_v5p_16", lambda found: pipeline_held_out_rows(found, "XLA:TPU, v5p-16")),
    ("tpu_plan", tpu_plan_rows),
    ("tpu_decisions", tpu_decisions_rows),
    ("mfu", mfu_rows),
    ("gpu_decisions", gpu_decisions_rows),
    ("h100_aot", h100_aot_rows),
)


def table() -> str:
    lines = ["| benchmark | result | target |", "|---|---|---|"]
    for name, rows in SECTIONS:
        lines += rows(load(name))
    machine = (load("overhead") or load("memory_and_communication") or {}).get("machine", "unknown machine")
    return (f"Measured on: {machine}.\nReproduce with `python benchmarks/run_all.py`.\n\n"
            + "\n".join(lines) + "\n")


def write_table() -> str:
    """Build the table from the JSON results and write it to the results' README and as the
    documentation page's last section (everything after its heading replaced)."""
    text = table()
    (RESULTS / "README.md").write_text(text)
    page = DOCS.read_text()
    DOCS.write_text(page[:page.index(TABLE_HEADING) + len(TABLE_HEADING)] + text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-slow", action="store_true",
                        help="skip the largest-model search, the plan-accuracy cases, the 512 MB data "
                             "benchmark and the nnx.vmap compiles (minutes)")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the table from the JSON results already there")
    options = parser.parse_args()
    if options.table_only:
        print(write_table())
        sys.exit()
    names = ["overhead", "memory_and_communication", "compile_time", "pipeline_bubble"] + (
        [] if options.skip_slow else ["largest_model", "plan_accuracy", "plan_held_out", "pipeline_held_out",
                                      "longest_sequence"])
    for name in names:
        run(["benchmarks/suite.py", name])
    run(["benchmarks/notebook_step_time.py"])
    run(["benchmarks/trainer_overhead.py"])
    run(["benchmarks/bpe_vs_bytes.py"])
    if not options.skip_slow:
        run(["benchmarks/lm_data.py"])
        run(["benchmarks/fault_battery.py"])
        run(["benchmarks/pipeline_vmap.py"])
    run(["benchmarks/layer_vjps.py"])
    run(["benchmarks/checkpoint_integrity.py"])
    run(["benchmarks/lora.py"])
    run(["benchmarks/ema.py"])
    run(["benchmarks/experts.py"])
    run(["benchmarks/post_training.py"])
    if not options.skip_slow:
        run(["benchmarks/hf_load.py"])
        run(["benchmarks/generation.py"])
    run(["benchmarks/default_sample.py", "after"])  # "before" and GPT_PRESETS ran on earlier checkouts
    if not options.skip_slow:
        run(["benchmarks/simulated_stress.py"])
    if importlib.util.find_spec("libtpu"):  # the tpu-plan extra: XLA:TPU compiles here, no TPU needed
        run(["benchmarks/tpu_plan.py", "--preset", "tiny", "--preset", "small"])
        run(["benchmarks/tpu_decisions.py"])
        run(["benchmarks/user_experts.py"])
        run(["benchmarks/plan_init_from.py"])
        run(["benchmarks/suite.py", "pipeline_held_out_tpu"])
    if has_gpu():
        run(["benchmarks/mfu.py"])
        run(["benchmarks/gpu_checks.py"])
        run(["benchmarks/ema.py", "--accelerator"])
    print(write_table())
