# Stand-in for each host's own hardware configuration, so that the example evaluates. Replace it
# with the host's hardware-configuration.nix and the GB10 kernel and NVIDIA driver, for example
# the public nixos-dgx-spark flake's hardware module; the runtime finds the driver's libcuda.so.1
# and libnvidia-ml.so.1 in /run/opengl-driver/lib, where hardware.nvidia puts them.
{
  boot.loader.systemd-boot.enable = true;
  fileSystems."/" = {
    device = "/dev/disk/by-label/nixos";
    fsType = "ext4";
  };
  hardware.graphics.enable = true;
  hardware.nvidia.open = true;
  services.xserver.videoDrivers = [ "nvidia" ];
  system.stateVersion = "26.05"; # the release this host was first installed with
}
