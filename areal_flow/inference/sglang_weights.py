"""The SGLang pool's weights: pausing, updates (folder, weight-update group, LoRA), catching up.

A LoRA adapter folder (`WeightUpdate.lora`) replaces the previous one on each server (LoRA enabled)
under `LORA_NAME`, which every ``/generate`` then names. An adapter runs over whatever base a
server holds, so a LoRA run attaching to servers (`base`) first loads its base model on each,
unless the server still holds it unchanged; one that cannot is refused."""

from __future__ import annotations

import asyncio
import logging

from areal_flow.inference.sglang_servers import (Server, WeightUpdateError, error_message,
                                                 lora_error)
from areal_flow.types import WeightUpdate

log = logging.getLogger(__name__)

LORA_NAME = "policy"
"""The name the policy's LoRA adapter is loaded under on every server."""


class Weights:

    async def _pause_locked(self) -> None:
        if self._paused:
            return
        self._paused = True
        self._epoch += 1
        await self._on_healthy("/pause_generation", {"mode": "abort"}, timeout=self._pause_timeout)

    async def _resume_locked(self) -> None:
        if not self._paused:
            return
        await self._on_healthy("/continue_generation", {}, timeout=self._pause_timeout)
        self._paused = False
        async with self._changed:
            self._changed.notify_all()

    async def _update_weights(self, update: WeightUpdate) -> None:
        was_paused = self._paused
        await self._pause_locked()
        try:
            if update.lora is not None:
                await self._load_adapter(update)
            elif update.path is not None:
                body = {"model_path": update.path, "weight_version": str(update.version),
                        "abort_all_requests": True, "flush_cache": True}
                done = await self._on_healthy("/update_weights_from_disk", body, strict=True)
                if not done:
                    raise WeightUpdateError(f"no SGLang server was reachable to load {update.path}")
                self._caught_up(done)
                self._disk = (update.path, update.version)
            else:
                meta = update.dist_meta
                members = self._members(meta.group_name)
                body = {"names": list(meta.names), "dtypes": list(meta.dtypes),
                        "shapes": [list(s) for s in meta.shapes], "group_name": meta.group_name,
                        "abort_all_requests": True, "flush_cache": True}
                # Only the last bucket names the version: a stale member keeps its own
                # until then, and the server checks that the buckets completed the model.
                last = update.version != self._version
                if last:
                    body["weight_version"] = str(update.version)
                # every member takes part in the broadcast, so one that is gone is an error
                await asyncio.gather(*(self._checked(s, "/update_weights_from_distributed", body)
                                       for s in members))
                if last:  # every member got every bucket of this version
                    self._caught_up(members, str(update.version))
            self._over_group = update.dist_meta is not None
            self._version = update.version
        finally:
            if not was_paused:
                await self._resume_locked()

    async def _load_adapter(self, update: WeightUpdate) -> None:
        """A LoRA adapter folder on every healthy server, as `LORA_NAME`."""
        if update.path is None:
            raise ValueError("the SGLang pool takes a LoRA adapter as a PEFT folder ('path'), "
                             "which its servers load with /load_lora_adapter")
        servers = [s for s in self._servers.values() if s.healthy]
        results = await asyncio.gather(
            *(self._swap_adapter(s, update.path, str(update.version)) for s in servers),
            return_exceptions=True)
        for server, result in zip(servers, results):
            # one that went down (taken out) catches up when it comes back
            if isinstance(result, BaseException) and (
                    server.healthy or not isinstance(result, WeightUpdateError)):
                raise result
        if not (done := [s for s, r in zip(servers, results) if r is None]):
            raise WeightUpdateError(f"no SGLang server was reachable to load {update.path}")
        self._caught_up(done)
        self._adapter, self._disk = (update.path, update.version), None

    async def _swap_adapter(self, server: Server, path: str, label: str) -> None:
        """Unload `server`'s adapter, then load `path`: SGLang refuses a second load of a name."""
        response = await self._post(server, "/unload_lora_adapter", {"lora_name": LORA_NAME})
        if response.status_code != 200 and "does not exist" not in lora_error(response):
            raise WeightUpdateError(f"{server.address}/unload_lora_adapter failed: "
                                    f"{error_message(response)}")
        await self._checked(server, "/load_lora_adapter",
                            {"lora_name": LORA_NAME, "lora_path": path})
        await self._checked(server, "/update_weight_version",
                            {"new_version": label, "abort_all_requests": True})
        server.label = label

    async def _load_paused(self, server: Server, path: str, version: int) -> None:
        """``/update_weights_from_disk`` on a server out of rotation, paused meanwhile: it may
        still run requests, and SGLang answers 400 to an update it applied while they run."""
        await self._checked(server, "/pause_generation", {"mode": "abort"},
                            timeout=self._pause_timeout)
        try:
            await self._checked(server, "/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "abort_all_requests": True,
                "flush_cache": True})
        finally:
            await self._quietly(self._post(server, "/continue_generation", {},
                                           timeout=self._pause_timeout))
        server.label = str(version)

    def _caught_up(self, servers: list[Server], label: str | None = None) -> None:
        for server in servers:
            if server.stale:
                log.info("SGLang server %s has the latest weights: back in rotation",
                         server.address)
            server.stale = False
            server.label = label or server.label

    def _members(self, group_name: str) -> list[Server]:
        members = self._groups.get(group_name)
        if members is None:
            raise WeightUpdateError(f"no weight-update group {group_name!r}; call "
                                    "init_weight_group first")
        return members

    async def _on_members(self, group_name: str, path: str, body: dict) -> list[BaseException]:
        """`path` on every member of the group at once; the errors, once every one answered."""
        results = await asyncio.gather(*(self._checked(s, path, body)
                                         for s in self._members(group_name)),
                                       return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]

    async def _begin_session(self, group_name: str) -> None:
        for _ in range(2):
            failed = await self._on_members(group_name, "/begin_weight_update", {"selector": "all"})
            if not failed:
                return
            # End the session on every member, then try once more: the ones this call opened,
            # one whose answer was lost, and one left open before (a trainer killed between
            # begin and end). SGLang keeps one session per server, whoever opened it, and lets
            # anyone end it; this run holds these servers, so no one else's session is open.
            await self._on_members(group_name, "/end_weight_update", {})
        raise failed[0]

    async def _end_session(self, group_name: str) -> None:
        # every member is closed, even when one fails
        if failed := await self._on_members(group_name, "/end_weight_update", {}):
            raise failed[0]

    async def _init_group(self, address: str, port: int, backend: str, group_name: str,
                          world_size: int | None, ranks_per_server: int) -> None:
        # Not under the control lock: joining blocks until the trainer joins too (or times out),
        # and pausing must not wait for that.
        if group_name in self._groups:
            raise WeightUpdateError(f"weight-update group {group_name!r} exists already")
        members = self._answering()
        size = 1 + ranks_per_server * len(members)
        if world_size is not None and world_size != size:
            raise WeightUpdateError(f"the servers changed: {len(members)} answer, but a "
                                    f"group of world size {world_size} was asked for")
        self._groups[group_name] = members
        try:
            await asyncio.gather(*(self._checked(s, "/init_weights_update_group", {
                "master_address": address, "master_port": port,
                "rank_offset": 1 + i * ranks_per_server, "world_size": size,
                "group_name": group_name, "backend": backend}, retry=False)
                for i, s in enumerate(members)))
        except BaseException:
            del self._groups[group_name]
            raise

    async def _destroy_group(self, group_name: str) -> None:
        await asyncio.gather(*(self._checked(s, "/destroy_weights_update_group",
                                             {"group_name": group_name})
                               for s in self._groups.pop(group_name, [])))

    async def _catch_up(self, server: Server, info: dict) -> None:
        """Give a joining server the latest weights, or mark it stale."""
        current = str(self._version)
        server.stale = False
        if server.known and server.label == current:
            return
        # a LoRA run's base, unless the server reports that folder, never updated
        if self._base is not None and not server.known and self._disk is None \
                and not self._over_group \
                and (info.get("model_path"), server.label) != (self._base, "default"):
            try:
                await self._load_paused(server, self._base, self._version)
            except WeightUpdateError as exc:
                self._unusable[server.address] = (
                    f"SGLang server {server.address} holds {info.get('model_path')!r} at weight "
                    f"version {server.label}, not this LoRA run's base model {self._base!r}, "
                    f"and could not load it: {exc}")
                raise WeightUpdateError(self._unusable[server.address]) from exc
        if self._adapter is not None:
            await self._swap_adapter(server, self._adapter[0], str(self._adapter[1]))
        if self._disk is not None and (not server.known or server.label != str(self._disk[1])):
            await self._load_paused(server, *self._disk)
        if server.label == current:
            return
        if self._over_group:
            server.stale = True
            log.warning("SGLang server %s joins after an update over the weight-update group, "
                        "which it was not in: out of rotation until the next update from disk or "
                        "over a new group (it has version %s, the pool %s)", server.address,
                        server.label, current)
            return
        await self._checked(server, "/update_weight_version",  # no update yet: a label only
                            {"new_version": current, "abort_all_requests": True})
        server.label = current

