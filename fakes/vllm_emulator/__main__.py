from fakes.vllm_emulator import main

main()
