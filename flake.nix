{
  description = "dspark: DeepSeek V4 Flash on two NVIDIA GB10 nodes (TP=2) as systemd services";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";

  outputs =
    { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;
      # The runtime carries NVIDIA's licences (torch, CUDA, cuDNN and NCCL wheels, the CUDA
      # toolkit), which nixpkgs.legacyPackages refuses: the flake's own package set allows them.
      # A NixOS host builds the runtime with its own pkgs and nixpkgs.config instead (see
      # nixosModules.default).
      pkgsFor =
        system:
        import nixpkgs {
          inherit system;
          config.allowUnfree = true;
          overlays = [ self.overlays.default ];
        };
      eachSystem = f: lib.genAttrs [ "aarch64-linux" "x86_64-linux" ] (system: f system (pkgsFor system));
      # The runtime's wheels are resolved for the GB10 nodes only.
      runtimeSystems = [ "aarch64-linux" ];
      # One runtime per runtime line (src/dspark/data/runtime_lines.toml), as runtime-<id with _ for .>.
      runtimeLines = import ./nix/lines.nix;
      template = import ./nix/template/hosts.nix;
    in
    {
      overlays.default = final: _: {
        dspark = final.callPackage ./nix/package.nix { };
        dspark-runtime = final.dspark-runtime-lines.${runtimeLines.default};
        dspark-runtime-lines = lib.mapAttrs (
          _: runtimeLine: final.callPackage ./nix/runtime.nix { inherit runtimeLine; }
        ) runtimeLines.lines;
      };

      packages = eachSystem (
        system: pkgs:
        {
          inherit (pkgs) dspark;
          default = pkgs.dspark;
        }
        // lib.optionalAttrs (lib.elem system runtimeSystems) (
          { runtime = pkgs.dspark-runtime; }
          // lib.mapAttrs' (id: line: lib.nameValuePair line.attr pkgs.dspark-runtime-lines.${id}) runtimeLines.lines
        )
      );

      apps = eachSystem (system: pkgs: pkgs.callPackage ./nix/apps.nix { inherit (pkgs) dspark; });

      # The package (with its tests) and the module, evaluated for the example head and worker.
      checks = eachSystem (
        system: pkgs:
        {
          inherit (pkgs) dspark;
        }
        // lib.mapAttrs' (
          name: _:
          lib.nameValuePair "module-${name}" (
            pkgs.callPackage ./nix/module-check.nix {
              inherit name;
              nixos = self.nixosConfigurations.${name};
            }
          )
        ) template.hosts
      );

      formatter = eachSystem (_: pkgs: pkgs.nixfmt);

      devShells = eachSystem (
        _: pkgs: {
          # Regenerate the runtime lock, replay its build, run the tests.
          default = pkgs.mkShell {
            packages = [
              (pkgs.python312.withPackages (ps: [
                ps.pip
                ps.packaging
                ps.uv
              ]))
              pkgs.nixfmt
            ];
          };
        }
      );

      nixosModules.default = import ./modules/default.nix;

      # The example pair (nix/template: `nix flake init -t`), evaluated by `nix flake check`.
      nixosConfigurations = lib.mapAttrs (
        name: host:
        lib.nixosSystem {
          system = "aarch64-linux";
          modules = [
            self.nixosModules.default
            ./nix/template/dspark-cluster.nix
            ./nix/template/example-hardware.nix
            host
          ];
        }
      ) template.hosts;

      templates.default = {
        path = ./nix/template;
        description = "Two GB10 hosts (head and worker) running dspark";
      };
    };
}
