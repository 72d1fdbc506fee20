// LingBot-World Play: the play panel. The node sends "lingbot.play" when it starts; the panel connects to the
// pack's WebSocket on ComfyUI's server, shows the frames as they come and sends keys while it has focus.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { dragToLook, fmt, ms, playKey, readFrame, releaseKeys } from "./play_client.js";

function openPanel(detail) {
  document.getElementById("lingbot-play")?.remove();
  const panel = document.createElement("div");
  panel.id = "lingbot-play";
  panel.tabIndex = 0;
  panel.style.cssText = "position:fixed;right:16px;top:64px;z-index:10000;background:#111;color:#ddd;" +
    "padding:8px;border:1px solid #444;border-radius:6px;font:12px monospace;outline:none";
  panel.innerHTML = '<div style="display:flex;justify-content:space-between;gap:8px">' +
    '<b>LingBot-World Play</b><span><button data-a="restart">Restart (R)</button> ' +
    '<button data-a="stop">Stop</button></span></div>' +
    '<img style="display:block;max-width:832px;margin-top:6px;cursor:grab;background:#000;min-width:416px;min-height:232px">' +
    '<pre data-a="hud" style="margin:4px 0"></pre>' +
    '<div>Click here, then W/A/S/D move, Shift run, Q/E down/up, arrows look, drag to look.</div>';
  document.body.appendChild(panel);
  window.lingbotPlayLog = [];  // every frame's index and camera (tests, curious users)
  const img = panel.querySelector("img"), hud = panel.querySelector('[data-a="hud"]');
  const url = new URL(api.apiURL(detail.ws), location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  let stats = {}, frames = 0, state = "connecting", blobUrl = null;
  const draw = () => {
    // the server paces the frames: the shown_* figures are as shown (a frame is shown when it arrives)
    hud.textContent = state + " | frames " + frames + " | FPS as played " + fmt(stats.shown_fps, 1) +
      " | s/chunk " + fmt(stats.s_per_chunk, 2) + " | key→pixel p50 " + ms(stats.shown_key_to_pixel_p50_s) +
      " p95 " + ms(stats.shown_key_to_pixel_p95_s) +
      (stats.vram ? " | VRAM " + fmt(stats.vram.allocated_gib, 1) + " GiB" : "");
  };
  const send = (o) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(o)); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      const m = JSON.parse(ev.data);
      if (m.type === "hello") state = m.role === "control" ? (m.ready ? "playing" : "loading") : "viewer";
      else if (m.type === "ready") state = "playing";
      else if (m.type === "stats") stats = m;
      else if (m.type === "error") state = "error: " + m.message;
      else if (m.type === "end") state = "ended: " + m.reason;
      draw();
      return;
    }
    const { jpeg, ...entry } = readFrame(ev.data);
    window.lingbotPlayLog.push(entry);
    if (blobUrl) URL.revokeObjectURL(blobUrl);
    blobUrl = URL.createObjectURL(jpeg);
    img.src = blobUrl;
    frames += 1;
    draw();
  };
  ws.onclose = () => { if (!state.startsWith("ended")) state = "disconnected"; draw(); };
  const onKey = (ev, down) => { if (playKey(ev, down, send)) ev.stopPropagation(); };  // not ComfyUI's keys
  panel.addEventListener("keydown", (ev) => onKey(ev, true));
  panel.addEventListener("keyup", (ev) => onKey(ev, false));
  panel.addEventListener("blur", () => releaseKeys(send));
  dragToLook(img, panel, send);
  panel.querySelector('[data-a="restart"]').onclick = () => send({ type: "restart" });
  panel.querySelector('[data-a="stop"]').onclick = () => { send({ type: "stop" }); };
  panel.focus();
  draw();
}

app.registerExtension({
  name: "LingBot.Play",
  setup() {
    api.addEventListener("lingbot.play", (ev) => openPanel(ev.detail));
  },
});
