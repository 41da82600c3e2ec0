gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4814304000000
  l2_cache_size: 62914560
  clock_rate_ghz: 1.98
  device_memory_size: 150109880320
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  scalar_unit_description {
    rate_infos {
      key: 4
      value {
        clock_rate_ghz: 1.98
        units_per_core: 64
        ops_per_clock: 1
      }
    }
    rate_infos {
      key: 8
      value {
        clock_rate_ghz: 1.98
        units_per_core: 64
        ops_per_clock: 1
      }
    }
    rate_infos {
      key: 10
      value {
        clock_rate_ghz: 1.98
        units_per_core: 128
        ops_per_clock: 2
      }
    }
    rate_infos {
      key: 11
      value {
        clock_rate_ghz: 1.98
        units_per_core: 128
        ops_per_clock: 1
      }
    }
    rate_infos {
      key: 12
      value {
        clock_rate_ghz: 1.98
        units_per_core: 64
        ops_per_clock: 1
      }
    }
    rate_infos {
      key: 16
      value {
        clock_rate_ghz: 1.98
        units_per_core: 128
        ops_per_clock: 2
      }
    }
  }
  matrix_unit_description {
    rate_infos {
      key: 2
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 6
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 10
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 512
      }
    }
    rate_infos {
      key: 11
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 256
      }
    }
    rate_infos {
      key: 12
      value {
        clock_rate_ghz: 1.98
        units_per_core: 4
        ops_per_clock: 32
      }
    }
    rate_infos {
      key: 16
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 512
      }
    }
    rate_infos {
      key: 19
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 20
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 23
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 24
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 25
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 28
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 29
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 33
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 35
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
    rate_infos {
      key: 36
      value {
        clock_rate_ghz: 1.82952011
        units_per_core: 4
        ops_per_clock: 1024
      }
    }
  }
  driver_version: "13.0.0"
  kernel_mode_driver_version: "580.159.4"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.19.0"
  cub_version: "3.2.0"
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  pci_bus_id: "<undefined>"
  name: "NVIDIA H200"
  model_str: "sm_9.0a with 150109880320B RAM, 132 cores, 1980000KHz clock, 3201000KHz mem clock, 62914560B L2$"
  numa_node: -1
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_address_bits: 64
  pcie_bandwidth: 68719476736
  ecc_enabled: true
  mem_clock_ghz: 3.201
  reserved_shared_memory_per_block: 1024
  max_blocks_per_multiprocessor: 32
  collective_memory_granularity: 2097152
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
runtime_version {
  major: 13
}
