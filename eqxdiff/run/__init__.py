"""What describes and rebuilds a run, for scripts, notebooks and tests alike: the kinds of a run (what x0 is,
`codecs`; what the network is conditioned on, `conditions`, SDXL's `sdxl_condition`; where the weights come from
and what trains, `finetune`), how a run's flags and data pick them (`open_condition`), the model table
(`models`: MODELS and CONSTRUCTORS, data a script extends), a run's directory (`run_dir`), the run rebuilt
from it (`rebuild.load_run`) and how it is sampled (`sampling.Sampling`, decided once from flags). train/main.py
writes what these read back; nothing here imports a script."""
