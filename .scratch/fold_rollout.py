"""Fold a new rollout_workload JSON into results/rollout_workload_<card>.json: new top level, old top level under
calls[<old_call_name>]."""
import json, sys
new_path, res_path, old_call, what = sys.argv[1:5]
new = json.load(open(new_path))
old = json.load(open(res_path))
calls = old.pop("calls", {})
keep = ("command", "date", "device", "bandwidth", "results", "decode_step", "comparison", "engine", "what", "notes")
calls[old_call] = {k: old[k] for k in keep if k in old}
new["what"] = what
new["calls"] = calls
json.dump(new, open(res_path, "w"), indent=1)
print("folded", new_path, "->", res_path, "old top under", old_call)
