"""`python -m vllm_gaudi_unified` is the console command `vllm-gaudi-unified`."""
from vllm_gaudi_unified.tools.cli import main

raise SystemExit(main())
