// The browser client of /v1/realtime: mic -> PCM16 16 kHz appends; answer audio played at the
// server's output rate through a jitter buffer; live texts; per-frame compute plot.
// `window.voicechat` exposes the counters (the browser test reads them).

const $ = (id) => document.getElementById(id);
const BUDGET_MS = 80;

const state = window.voicechat = {};
function resetState() {
  Object.assign(state, {
    status: 'idle', frames: 0, frameIndices: [], deltaSamples: [], samplesReceived: 0, tailSamples: 0,
    samplesPlayed: 0, underruns: 0, transcript: '', text: '', functionText: '', done: false, cancelled: false,
    closed: false, closeCode: null, errors: [], compute: [], lag: [], outputRate: null, outputFrameSamples: null,
    appendsSent: 0, samplesSent: 0, micRate: null, samplesDropped: 0, bargeIns: 0, lastUserFrame: -1000,
    loudFrames: [],
  });
}
resetState();

let ws = null, micCtx = null, micStream = null, micNode = null, playCtx = null, playNode = null;

$('url').value = (location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/v1/realtime';

function setStatus(s, cls) {
  state.status = s;
  const el = $('status');
  el.textContent = s;
  el.className = 'status ' + (cls || '');
}

function buttons(running) {
  $('start').disabled = running;
  $('stop').disabled = !running;
  $('cancel').disabled = !running;
}

function send(obj) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(obj));
}

function toBase64(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function fromBase64(b64) {
  const s = atob(b64);
  const bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return new Int16Array(bytes.buffer);  // little-endian, as every browser platform is
}

function showError(code, message) {
  state.errors.push({ code, message });
  $('errors').textContent = state.errors.map((e) => `${e.code}: ${e.message}`).join('\n');
}

async function start() {
  resetState();
  $('transcript').textContent = $('answer').textContent = $('function').textContent = $('errors').textContent = '';
  drawPlot();
  buttons(true);
  setStatus('connecting');
  const key = $('apikey').value.trim();
  try {
    ws = new WebSocket($('url').value, key ? ['voicechat.bearer.' + key] : []);
  } catch (err) {
    showError('connect', String(err));
    buttons(false);
    return;
  }
  ws.onmessage = (m) => onEvent(JSON.parse(m.data));
  ws.onclose = (e) => {
    state.closed = true;
    state.closeCode = e.code;
    stopMic();
    buttons(false);
    if (state.done || state.cancelled) setStatus(state.done ? 'done' : 'cancelled');
    else setStatus('closed (' + e.code + ')', e.code === 1000 ? '' : 'error');
  };
  ws.onerror = () => showError('connection', 'WebSocket error (server down, wrong key or origin?)');
}

async function startAudio() {
  // Speaker first: a context at the server's output rate, so no resampling on our side.
  playCtx = new AudioContext({ sampleRate: state.outputRate });
  await playCtx.audioWorklet.addModule('/static/worklets.js');
  playNode = new AudioWorkletNode(playCtx, 'pcm16-player', {
    outputChannelCount: [1], processorOptions: { prefill: Math.round(state.outputRate * 0.12) },
  });
  playNode.port.onmessage = (e) => {
    state.samplesPlayed = e.data.played;
    state.underruns = e.data.underruns;
    state.samplesDropped = e.data.dropped;
    updateStats();
  };
  playNode.connect(playCtx.destination);
  await playCtx.resume();

  micStream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false },
  });
  // A 16 kHz context lets the browser resample the mic; where it cannot (Firefox refuses a stream
  // at another rate) or with ?capture=native, the context runs at the device rate and the
  // capture worklet resamples.
  let source = null;
  if (new URLSearchParams(location.search).get('capture') !== 'native') {
    try {
      micCtx = new AudioContext({ sampleRate: 16000 });
      source = micCtx.createMediaStreamSource(micStream);
    } catch (err) {
      if (micCtx) micCtx.close();
      micCtx = null;
      source = null;
    }
  }
  if (!source) {
    micCtx = new AudioContext();
    source = micCtx.createMediaStreamSource(micStream);
  }
  state.micRate = micCtx.sampleRate;
  await micCtx.audioWorklet.addModule('/static/worklets.js');
  micNode = new AudioWorkletNode(micCtx, 'pcm16-capture', { processorOptions: { chunk: 640 } });
  micNode.port.onmessage = (e) => {
    if (e.data === 'stopped') { send({ type: 'input_audio_buffer.commit', pad_partial: true }); return; }
    state.appendsSent += 1;
    state.samplesSent += e.data.length;
    send({ type: 'input_audio_buffer.append', audio: toBase64(e.data), sample_rate: 16000 });
  };
  const mute = micCtx.createGain();
  mute.gain.value = 0;
  source.connect(micNode).connect(mute).connect(micCtx.destination);
  await micCtx.resume();
  setStatus('live', 'live');
}

function stopMic() {
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (micCtx) micCtx.close();
  micStream = micCtx = micNode = null;
}

function stop() {
  $('stop').disabled = true;
  setStatus('finishing');
  if (micNode) micNode.port.postMessage('stop');  // flushes the last samples, then commits
  else send({ type: 'input_audio_buffer.commit', pad_partial: true });
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
}

function cancel() {
  send({ type: 'response.cancel' });
  stopMic();
  if (playNode) playNode.port.postMessage('reset');
}

// Barge-in: a user utterance that starts (its first transcript token after BARGE_GAP quiet frames)
// while the model was speaking (a frame above -50 dBFS among the last 3) drops the playback buffer,
// so the user does not hear the rest of what the model had already said. The model itself stops
// talking when interrupted (full duplex); ?bargein=off keeps the buffer.
const BARGE_GAP = 8, SPEECH_PEAK = Math.round(32768 * 10 ** (-50 / 20));
const bargeInOn = new URLSearchParams(location.search).get('bargein') !== 'off';
function peak(pcm) {
  let m = 0;
  for (let i = 0; i < pcm.length; i++) { const a = Math.abs(pcm[i]); if (a > m) m = a; }
  return m;
}
function bargeIn(frame) {
  const starts = frame - state.lastUserFrame >= BARGE_GAP;
  state.lastUserFrame = frame;
  const loud = state.loudFrames;
  const speaking = loud.length > 0 && frame - loud[loud.length - 1] <= 3;
  if (bargeInOn && starts && speaking && playNode) {
    state.bargeIns += 1;
    playNode.port.postMessage('bargein');
  }
}

function onEvent(e) {
  switch (e.type) {
    case 'session.created':
      send({ type: 'session.update', session: {
        system_prompt: $('prompt').value.trim() || null, seed: parseInt($('seed').value || '0', 10) } });
      break;
    case 'session.updated':
      state.outputRate = e.session.output_audio_format.sample_rate;
      state.outputFrameSamples = e.session.output_frame_samples;
      startAudio().catch((err) => { showError('audio', String(err)); cancel(); });
      break;
    case 'conversation.item.input_audio_transcription.delta':
      bargeIn(e.frame_index);
      state.transcript = e.transcript;
      $('transcript').textContent = e.transcript;
      break;
    case 'response.text.delta':
      state.text = e.text;
      $('answer').textContent = e.text;
      break;
    case 'response.function.delta':
      state.functionText = e.text;
      $('function').textContent = e.text;
      break;
    case 'response.audio.delta': {
      const pcm = fromBase64(e.delta);
      state.frames += 1;
      state.frameIndices.push(e.frame_index);
      state.deltaSamples.push(pcm.length);
      if (peak(pcm) > SPEECH_PEAK) state.loudFrames.push(e.frame_index);
      state.samplesReceived += pcm.length;
      state.compute.push(e.compute_ms);
      state.lag.push(e.lag_ms);
      if (playNode) playNode.port.postMessage(pcm, [pcm.buffer]);
      schedulePlot();
      break;
    }
    case 'response.audio.tail': {
      const pcm = fromBase64(e.delta);
      state.tailSamples = pcm.length;
      state.samplesReceived += pcm.length;
      if (playNode) playNode.port.postMessage(pcm, [pcm.buffer]);
      break;
    }
    case 'response.done':
      state.done = true;
      if (playNode) playNode.port.postMessage('end');
      break;
    case 'response.cancelled':
      state.cancelled = true;
      break;
    case 'error':
      showError(e.error.code, e.error.message);
      break;
  }
}

// -- plot: compute time per frame (bars), lag / 10 (line), the 80 ms budget (dashed)

let plotPending = false;
function schedulePlot() {
  if (plotPending) return;
  plotPending = true;
  requestAnimationFrame(() => { plotPending = false; drawPlot(); updateStats(); });
}

function drawPlot() {
  const c = $('plot'), g = c.getContext('2d');
  const W = c.width, H = c.height, pad = 28;
  g.clearRect(0, 0, W, H);
  const n = Math.min(state.compute.length, 300);
  const comp = state.compute.slice(-n), lag = state.lag.slice(-n).map((x) => x / 10);
  const top = Math.max(BUDGET_MS * 1.5, ...comp, ...lag) * 1.05;
  const y = (v) => H - pad - (v / top) * (H - 2 * pad);
  g.font = '11px monospace';
  g.fillStyle = '#66707a';
  g.strokeStyle = '#eef0f3';
  const raw = top / 6, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  for (let v = 0; v <= top; v += step) {
    g.beginPath(); g.moveTo(pad, y(v)); g.lineTo(W, y(v)); g.stroke();
    g.fillText(String(v), 2, y(v) + 4);
  }
  const bw = (W - pad) / 300;
  g.fillStyle = '#2b6cb0';
  comp.forEach((v, i) => g.fillRect(pad + i * bw, y(v), Math.max(1, bw - 1), H - pad - y(v)));
  g.strokeStyle = '#dd6b20';
  g.beginPath();
  lag.forEach((v, i) => (i ? g.lineTo : g.moveTo).call(g, pad + i * bw + bw / 2, y(v)));
  g.stroke();
  g.strokeStyle = '#c53030';
  g.setLineDash([6, 4]);
  g.beginPath(); g.moveTo(pad, y(BUDGET_MS)); g.lineTo(W, y(BUDGET_MS)); g.stroke();
  g.setLineDash([]);
}

function updateStats() {
  const comp = state.compute;
  const mean = comp.length ? comp.reduce((a, b) => a + b, 0) / comp.length : 0;
  const sorted = comp.slice().sort((a, b) => a - b);
  const p95 = sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(0.95 * (sorted.length - 1)))] : 0;
  const lag = state.lag.length ? state.lag[state.lag.length - 1] : 0;
  $('stats').textContent =
    `frames ${state.frames} · compute mean ${mean.toFixed(1)} ms p95 ${p95.toFixed(1)} ms (budget ${BUDGET_MS})` +
    ` · lag ${lag.toFixed(0)} ms · played ${state.samplesPlayed}/${state.samplesReceived} samples` +
    ` @ ${state.outputRate || '-'} Hz · underruns ${state.underruns}`;
}

$('start').addEventListener('click', start);
$('stop').addEventListener('click', stop);
$('cancel').addEventListener('click', cancel);
drawPlot();
updateStats();
