# The part both hosts share: the cluster file and the service. CHANGEME: addresses, interfaces,
# RDMA devices and the model path are those of the tested GB10 pair; write your own.
{
  # The runtime carries NVIDIA's licences (CUDA, cuDNN, NCCL); the module builds it with this
  # host's nixpkgs, so this host must allow it.
  nixpkgs.config.allowUnfree = true;

  services.dspark = {
    enable = true;
    openFirewall = true; # the head's API port; trusts the fabric interface between the nodes
    apiKeyFile = "/run/secrets/dspark-api-key"; # outside the Nix store
    settings = {
      model.path = "/var/lib/dspark/models/DeepSeek-V4-Flash";
      serving.max_model_len = 350000;
      nodes = [
        {
          name = "spark-a";
          rank = 0;
          address = "192.168.100.10";
          socket_ifname = "enp1s0f0np0";
          rdma_device = "rocep1s0f0";
          gid_index = "auto";
          api_port = 8888;
        }
        {
          name = "spark-b";
          rank = 1;
          address = "192.168.100.11";
          socket_ifname = "enp1s0f0np0";
          rdma_device = "rocep1s0f0";
          gid_index = "auto";
        }
      ];
    };
  };
}
