// AudioWorklet processors of the page: microphone capture -> PCM16 at 16 kHz, and a PCM player
// with a small jitter buffer. Loaded with audioWorklet.addModule('/static/worklets.js').

const TARGET_RATE = 16000;

// Mic capture. If the context already runs at 16 kHz (the page asks for it) samples pass
// through; otherwise a windowed-sinc low-pass at 0.45 x 16 kHz, then linear interpolation.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.chunk = (options.processorOptions && options.processorOptions.chunk) || 640; // 40 ms
    this.ratio = sampleRate / TARGET_RATE;
    this.out = new Int16Array(this.chunk);
    this.n = 0;
    this.active = true;
    this.port.onmessage = (e) => {
      if (e.data === 'stop') { this.flushOut(); this.active = false; this.port.postMessage('stopped'); }
    };
    if (this.ratio !== 1) {
      const taps = 63, fc = 0.45 * TARGET_RATE / sampleRate, h = new Float32Array(taps);
      let sum = 0;
      for (let i = 0; i < taps; i++) {
        const m = i - (taps - 1) / 2;
        const sinc = m === 0 ? 2 * fc : Math.sin(2 * Math.PI * fc * m) / (Math.PI * m);
        const w = 0.42 - 0.5 * Math.cos(2 * Math.PI * i / (taps - 1)) + 0.08 * Math.cos(4 * Math.PI * i / (taps - 1));
        h[i] = sinc * w; sum += h[i];
      }
      for (let i = 0; i < taps; i++) h[i] /= sum;
      this.h = h;
      this.hist = new Float32Array(taps);  // circular history of input samples
      this.hpos = 0;
      this.t = 0;          // position of the next output sample, in input samples
      this.count = 0;      // input samples seen
      this.prev = 0;       // last filtered sample
    }
  }
  emit(x) {
    const v = Math.max(-1, Math.min(1, x));
    this.out[this.n++] = Math.round(v * 32767);
    if (this.n === this.chunk) this.flushOut();
  }
  flushOut() {
    if (this.n === 0) return;
    const pcm = this.out.slice(0, this.n);
    this.port.postMessage(pcm, [pcm.buffer]);
    this.n = 0;
  }
  process(inputs) {
    if (!this.active) return false;
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    if (this.ratio === 1) {
      for (let i = 0; i < input.length; i++) this.emit(input[i]);
      return true;
    }
    const h = this.h, taps = h.length;
    for (let i = 0; i < input.length; i++) {
      this.hist[this.hpos] = input[i];
      this.hpos = (this.hpos + 1) % taps;
      let y = 0;
      for (let k = 0; k < taps; k++) y += h[k] * this.hist[(this.hpos + k) % taps];
      // y is the filtered sample at input index `count`; interpolate outputs in (count-1, count].
      while (this.t <= this.count) {
        const frac = this.t - (this.count - 1);
        this.emit(this.prev + (y - this.prev) * Math.max(0, frac));
        this.t += this.ratio;
      }
      this.prev = y;
      this.count += 1;
    }
    return true;
  }
}

// Player: Int16 PCM chunks in, played at the context's rate (the server's output rate).
// Starts once `prefill` samples are queued; on underrun it plays silence and refills.
class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.prefill = (options.processorOptions && options.processorOptions.prefill) || 2646;
    this.queue = [];
    this.head = 0;        // read position in queue[0]
    this.buffered = 0;
    this.playing = false;
    this.played = 0;      // real samples played (silence not counted)
    this.underruns = 0;
    this.dropped = 0;     // samples dropped on barge-in
    this.ended = false;   // the server sent the last audio: play out what is left without prefill
    this.lastReport = 0;
    this.port.onmessage = (e) => {
      if (e.data === 'end') { this.ended = true; return; }
      if (e.data === 'reset') { this.queue = []; this.head = 0; this.buffered = 0; this.playing = false; return; }
      if (e.data === 'bargein') {
        // The user speaks over the model: what is still buffered is dropped (counted), playback goes on
        // with what the server sends next.
        this.dropped += this.buffered;
        this.queue = []; this.head = 0; this.buffered = 0; this.playing = false;
        this.port.postMessage({ played: this.played, buffered: 0, underruns: this.underruns, dropped: this.dropped });
        return;
      }
      this.queue.push(e.data);
      this.buffered += e.data.length;
      if (this.buffered >= this.prefill) this.playing = true;
    };
  }
  process(inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    if (this.playing || (this.ended && this.buffered > 0)) {
      while (i < out.length && this.queue.length) {
        const c = this.queue[0];
        const k = Math.min(out.length - i, c.length - this.head);
        for (let j = 0; j < k; j++) out[i + j] = c[this.head + j] / 32768;
        i += k; this.head += k; this.buffered -= k; this.played += k;
        if (this.head === c.length) { this.queue.shift(); this.head = 0; }
      }
      if (i < out.length && !this.ended) { this.underruns += 1; this.playing = false; }
    }
    for (; i < out.length; i++) out[i] = 0;
    for (let ch = 1; ch < outputs[0].length; ch++) outputs[0][ch].set(out);
    if (currentFrame - this.lastReport >= sampleRate / 20 || (this.ended && this.buffered === 0)) {
      this.lastReport = currentFrame;
      this.port.postMessage({ played: this.played, buffered: this.buffered, underruns: this.underruns,
                              dropped: this.dropped });
    }
    return true;
  }
}

registerProcessor('pcm16-capture', CaptureProcessor);
registerProcessor('pcm16-player', PlayerProcessor);
