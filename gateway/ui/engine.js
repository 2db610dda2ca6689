/* Engine: every local engine live, from GET /admin/engine once a second, with the last minute as charts, and how
 * the engine shares itself between tenants (a key's team, else the key): each one's weight, running and waiting
 * sequences, tokens served since start and its share of the tokens served over the last SHARE_WINDOW polls. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const POLL_MS = 1000;
  const HISTORY = 60;
  const SHARE_WINDOW = 10; // polls (seconds) over which the "share now" column counts served tokens
  const MAX_TENANT_ROWS = 20; // the most served tenants; the rest are counted in one line

  /** tenant -> tokens served since start, from a stats answer (its `tenants`). */
  function servedOf(s) {
    const served = {};
    for (const [tenant, v] of Object.entries(s.tenants || {})) served[tenant] = v.served_tokens || 0;
    return served;
  }

  /** The shares table of one engine: `before` is the served tokens SHARE_WINDOW polls ago (or the oldest kept). */
  function sharesTable(s, before) {
    const tenants = s.tenants || {};
    const waiting = s.waiting_by_tenant || {};
    const running = s.running_by_tenant || {};
    const names = Array.from(new Set([...Object.keys(tenants), ...Object.keys(waiting), ...Object.keys(running)]));
    if (!names.length) return null;
    const served = servedOf(s);
    const recent = {};
    let recentTotal = 0;
    let total = 0;
    for (const name of names) {
      recent[name] = Math.max(0, (served[name] || 0) - ((before && before[name]) || 0));
      recentTotal += recent[name];
      total += served[name] || 0;
    }
    names.sort((a, b) => (recent[b] - recent[a]) || ((served[b] || 0) - (served[a] || 0)) || a.localeCompare(b));
    const rows = names.slice(0, MAX_TENANT_ROWS).map((name) => {
      const t = tenants[name] || {};
      return h('tr', { 'data-tenant': name },
        h('td', {}, name || 'anonymous'),
        h('td', { class: 'num', 'data-col': 'weight' }, t.weight === undefined ? '—' : UG.fmt(t.weight)),
        h('td', { class: 'num', 'data-col': 'running' }, UG.fmt(running[name] || 0)),
        h('td', { class: 'num', 'data-col': 'waiting' }, UG.fmt(waiting[name] || 0)),
        h('td', { class: 'num', 'data-col': 'served' }, UG.fmt(served[name] || 0)),
        h('td', { class: 'num', 'data-col': 'share' }, recentTotal ? UG.pct(recent[name] / recentTotal) : '—'),
        h('td', { class: 'num', 'data-col': 'share_total' }, total ? UG.pct((served[name] || 0) / total) : '—'),
        h('td', { class: 'num', 'data-col': 'preemptions' }, UG.fmt(t.preemptions || 0)),
        h('td', { class: 'num', 'data-col': 'queue' }, UG.fmt(t.queue_time_s || 0, 1)));
    });
    const hidden = names.length - rows.length;
    return h('div', { class: 'shares', 'data-shares': s.name },
      h('h3', {}, 'Shares by tenant'),
      h('p', { class: 'muted' }, 'A tenant is a key\'s team, else the key. The engine admits (and, when full, ' +
        'preempts) by each tenant\'s tokens served per unit of weight; "share now" counts the last ' +
        SHARE_WINDOW + ' s.' + (hidden > 0 ? ' ' + hidden + ' less served tenants are not listed.' : '')),
      h('div', { class: 'table-wrap' }, h('table', {},
        h('thead', {}, h('tr', {}, ['Tenant', 'Weight', 'Running', 'Waiting', 'Tokens served', 'Share now',
          'Share since start', 'Preemptions', 'Queue time (s)'].map((label) => h('th', {}, label)))),
        h('tbody', {}, rows))));
  }

  function stat(label, value, name) {
    return h('div', { class: 'stat', 'data-stat': name },
      h('div', { class: 'value' }, value), h('div', { class: 'label' }, label));
  }

  UG.pages.engine = {
    title: 'Engine',
    render(root) {
      const box = h('div', { id: 'engines' });
      const error = h('p', { class: 'error' });
      const history = {}; // engine name -> [{t, running, waiting, gen, prompt, served}]
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
            gen: s.generation_tokens_per_s || 0, prompt: s.prompt_tokens_per_s || 0, served: servedOf(s) });
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
        const before = points.length ? points[Math.max(0, points.length - 1 - SHARE_WINDOW)].served : null;
        return [h('div', { class: 'card engine', 'data-engine': s.name }, head,
          h('p', { class: 'muted' }, [s.device, s.dtype, 'KV ' + s.kv_cache_dtype, s.attention_backend, s.ops,
            'context ' + UG.fmt(s.max_model_len)].filter(Boolean).join(' · ')),
          h('div', { class: 'grid' }, stats),
          sharesTable(s, before),
          h('div', { class: 'grid wide' }, kvMeter, memoryChart),
          h('div', { class: 'grid wide' }, queues, rates)), drawCharts];
      }
    },
  };
})();
