/* Engine: every local engine live, from GET /admin/engine once a second, with the last minute as charts. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const POLL_MS = 1000;
  const HISTORY = 60;

  function stat(label, value, name) {
    return h('div', { class: 'stat', 'data-stat': name },
      h('div', { class: 'value' }, value), h('div', { class: 'label' }, label));
  }

  UG.pages.engine = {
    title: 'Engine',
    render(root) {
      const box = h('div', { id: 'engines' });
      const error = h('p', { class: 'error' });
      const history = {}; // engine name -> [{t, running, waiting, gen, prompt}]
      const started = Date.now();
      root.append(h('h1', {}, 'Engine'), h('p', { class: 'muted' }, 'Local engines, refreshed every second.'), error,
        box);

      UG.every(POLL_MS, async () => {
        let result;
        try {
          result = await UG.api('GET', '/admin/engine');
          error.textContent = '';
        } catch (e) { error.textContent = e.message; return; }
        const t = (Date.now() - started) / 1000;
        for (const s of result.data) {
          const list = history[s.name] = history[s.name] || [];
          list.push({ t: t, running: s.num_running_seqs || 0, waiting: s.num_waiting_seqs || 0,
            gen: s.generation_tokens_per_s || 0, prompt: s.prompt_tokens_per_s || 0 });
          if (list.length > HISTORY) list.shift();
        }
        draw(result.data);
      });

      function draw(engines) {
        UG.clear(box);
        if (!engines.length) {
          box.appendChild(h('p', { class: 'muted' }, 'No local engine is routed on this gateway.'));
          return;
        }
        for (const s of engines) {
          const [node, drawCharts] = card(s);
          box.appendChild(node);
          drawCharts(); // once in the page, so each chart takes its container's width
        }
      }

      function card(s) {
        const head = h('h2', {}, s.model + ' · ' + s.name + ' ',
          h('span', { class: 'badge ' + (s.state || ''), 'data-state': s.state }, s.state || '?'));
        if (!s.loaded) {
          return [h('div', { class: 'card engine', 'data-engine': s.name }, head,
            h('p', { class: 'muted' }, s.load_failed ? 'The model failed to load (see the log).' : 'Loading the model…')),
          () => {}];
        }
        const memory = s.memory_bytes || {};
        const other = memory.peak - memory.weights - memory.kv_cache;
        const kvMeter = h('div', { class: 'chart' });
        const memoryChart = h('div', { class: 'chart' });
        const queues = h('div', { class: 'chart' });
        const rates = h('div', { class: 'chart' });
        const points = history[s.name] || [];
        const drawCharts = () => {
          UnigateCharts.bars(kvMeter, { categories: ['KV blocks'], stacked: true, height: 120, y: { label: 'blocks' },
            series: [{ name: 'used', values: [s.kv_blocks_used] }, { name: 'free', values: [s.kv_blocks_free] }] });
          // On CPU the peak is the process's peak resident size, so "other" is everything besides weights and KV.
          UnigateCharts.bars(memoryChart, { categories: ['memory'], stacked: true, height: 120, y: { label: 'MiB' },
            series: [['weights', memory.weights], ['KV cache', memory.kv_cache],
              ['other (peak − weights − KV)', other > 0 ? other : 0]].map(([name, value]) => (
              { name: name, values: [(value || 0) / 1048576] })) });
          UnigateCharts.line(queues, { x: { label: 'seconds' }, y: { label: 'sequences', min: 0 }, height: 180,
            series: [{ name: 'running', points: points.map((p) => [p.t, p.running]) },
              { name: 'waiting', points: points.map((p) => [p.t, p.waiting]) }] });
          UnigateCharts.line(rates, { x: { label: 'seconds' }, y: { label: 'tokens/s', min: 0 }, height: 180,
            series: [{ name: 'generation', points: points.map((p) => [p.t, p.gen]) },
              { name: 'prompt', points: points.map((p) => [p.t, p.prompt]) }] });
        };
        const stats = [
          stat('Running', UG.fmt(s.num_running_seqs), 'running'),
          stat('Waiting', UG.fmt(s.num_waiting_seqs), 'waiting'),
          stat('KV blocks used / free', UG.fmt(s.kv_blocks_used) + ' / ' + UG.fmt(s.kv_blocks_free), 'kv'),
          stat('Prefix-cache hit rate', UG.pct(s.prefix_cache_hit_rate), 'prefix'),
          stat('Generation tokens/s', UG.fmt(s.generation_tokens_per_s, 1), 'gen_rate'),
          stat('Prompt tokens/s', UG.fmt(s.prompt_tokens_per_s, 1), 'prompt_rate'),
          stat('Tokens generated', UG.fmt(s.generation_tokens_total), 'gen_total'),
          stat('Preemptions', UG.fmt(s.num_preemptions_total), 'preemptions'),
          stat('Weights / KV / peak', UG.bytes(memory.weights) + ' / ' + UG.bytes(memory.kv_cache) + ' / ' +
            UG.bytes(memory.peak), 'memory'),
        ];
        if (s.spec_method && s.spec_method !== 'off') {
          stats.push(stat('Speculative acceptance (' + s.spec_method + ')', UG.pct(s.spec_acceptance_rate) + ' · ' +
            UG.fmt(s.spec_mean_tokens_per_step, 2) + ' tok/step', 'spec'));
        }
        return [h('div', { class: 'card engine', 'data-engine': s.name }, head,
          h('p', { class: 'muted' }, [s.device, s.dtype, 'KV ' + s.kv_cache_dtype, s.attention_backend, s.ops,
            'context ' + UG.fmt(s.max_model_len)].filter(Boolean).join(' · ')),
          h('div', { class: 'grid' }, stats),
          h('div', { class: 'grid wide' }, kvMeter, memoryChart),
          h('div', { class: 'grid wide' }, queues, rates)), drawCharts];
      }
    },
  };
})();
