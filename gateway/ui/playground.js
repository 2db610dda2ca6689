/* Playground: stream a chat through the gateway with a key the operator pastes (kept in this page's memory only),
 * show TTFT, tokens/s and the request id, and copy the request as curl / OpenAI SDK / Anthropic SDK code. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  let pastedKey = ''; // memory only: survives page switches, never a reload, never written to storage

  function pyString(s) { return JSON.stringify(s); }

  function snippets(base, body) {
    const messages = body.messages;
    const user = messages.filter((m) => m.role === 'user').map((m) => m.content).join('\n');
    const system = messages.filter((m) => m.role === 'system').map((m) => m.content).join('\n');
    const curlBody = JSON.stringify(body).replace(/'/g, "'\\''");
    return {
      curl: 'curl -N ' + base + '/v1/chat/completions \\\n' +
        '  -H "Authorization: Bearer $UNIGATE_API_KEY" \\\n' +
        '  -H "Content-Type: application/json" \\\n' +
        "  -d '" + curlBody + "'",
      openai: 'import os\nfrom openai import OpenAI\n\n' +
        'client = OpenAI(base_url=' + pyString(base + '/v1') + ', api_key=os.environ["UNIGATE_API_KEY"])\n' +
        'stream = client.chat.completions.create(\n' +
        '    model=' + pyString(body.model) + ',\n' +
        '    messages=' + JSON.stringify(messages) + ',\n' +
        '    max_tokens=' + body.max_tokens + ',\n' +
        '    temperature=' + body.temperature + ',\n' +
        '    stream=True,\n)\n' +
        'for chunk in stream:\n    if chunk.choices:\n        print(chunk.choices[0].delta.content or "", end="")\n',
      anthropic: 'import os\nimport anthropic\n\n' +
        'client = anthropic.Anthropic(base_url=' + pyString(base) + ', api_key=os.environ["UNIGATE_API_KEY"])\n' +
        'with client.messages.stream(\n' +
        '    model=' + pyString(body.model) + ',\n' +
        '    max_tokens=' + body.max_tokens + ',\n' +
        (system ? '    system=' + pyString(system) + ',\n' : '') +
        '    messages=[{"role": "user", "content": ' + pyString(user) + '}],\n' +
        '    temperature=' + body.temperature + ',\n) as stream:\n' +
        '    for text in stream.text_stream:\n        print(text, end="")\n',
    };
  }

  /** Read an OpenAI SSE stream; calls onEvent(object) per data line; resolves at [DONE] or the end. */
  async function readStream(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf('\n')) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, '');
        buffer = buffer.slice(end + 1);
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') return;
        onEvent(JSON.parse(data));
      }
    }
  }

  UG.pages.playground = {
    title: 'Playground',
    render(root) {
      const model = h('select', { id: 'pg-model' });
      const key = h('input', { id: 'pg-key', type: 'password', autocomplete: 'off', placeholder: 'sk-ug-…',
        value: pastedKey, oninput: () => { pastedKey = key.value.trim(); } });
      const system = h('textarea', { id: 'pg-system', rows: 2, placeholder: 'System prompt (optional)' });
      const prompt = h('textarea', { id: 'pg-prompt', rows: 4 }, 'Say hello in five words.');
      const maxTokens = h('input', { id: 'pg-max-tokens', type: 'number', min: 1, value: 64 });
      const temperature = h('input', { id: 'pg-temperature', type: 'number', min: 0, max: 2, step: 0.1, value: 0.7 });
      const send = h('button', { type: 'submit', id: 'pg-send' }, 'Send');
      const output = h('div', { class: 'output', id: 'pg-output', 'aria-live': 'polite' });
      const status = h('p', { class: 'error', id: 'pg-error', role: 'alert' });
      const metrics = h('div', { class: 'grid', id: 'pg-metrics' });
      const code = h('pre', { id: 'pg-code' });
      const tabs = h('div', { class: 'tabs' });
      let shown = 'curl';
      let lastSnippets = null;
      let controller = null;

      const form = h('form', { class: 'card', autocomplete: 'off' },
        h('div', { class: 'row' },
          h('label', { class: 'grow' }, 'Model', model),
          h('label', { class: 'grow' }, 'API key (kept in memory only)', key),
          h('label', {}, 'Max tokens', maxTokens), h('label', {}, 'Temperature', temperature)),
        h('label', {}, 'System', system), h('label', {}, 'Message', prompt),
        h('div', { class: 'row' }, send,
          h('button', { type: 'button', class: 'secondary', onclick: () => controller && controller.abort() }, 'Stop')));
      root.append(h('h1', {}, 'Playground'), form, status, h('div', { class: 'card' }, output, metrics),
        h('div', { class: 'card' }, h('div', { class: 'row' }, h('h2', { class: 'grow' }, 'Copy as'),
          h('button', { type: 'button', class: 'secondary', id: 'pg-copy', onclick: (e) => UG.copy(code.textContent,
            e.target) }, 'Copy')), tabs, code));
      UG.onLeave(() => controller && controller.abort());

      for (const [name, label] of [['curl', 'curl'], ['openai', 'OpenAI SDK'], ['anthropic', 'Anthropic SDK']]) {
        tabs.appendChild(h('button', { type: 'button', 'data-tab': name, onclick: () => { shown = name; drawCode(); } },
          label));
      }

      function body() {
        const messages = [];
        if (system.value.trim()) messages.push({ role: 'system', content: system.value });
        messages.push({ role: 'user', content: prompt.value });
        return { model: model.value, messages: messages, max_tokens: Number(maxTokens.value) || 64,
          temperature: Number(temperature.value), stream: true };
      }

      function drawCode() {
        lastSnippets = snippets(location.origin, body());
        code.textContent = lastSnippets[shown];
        for (const tab of tabs.children) tab.classList.toggle('active', tab.dataset.tab === shown);
      }
      for (const input of [model, system, prompt, maxTokens, temperature]) input.addEventListener('input', drawCode);

      function showMetrics(values) {
        UG.clear(metrics).append(...values.map(([label, value, name]) => h('div', { class: 'stat', 'data-stat': name },
          h('div', { class: name === 'request_id' ? 'value small' : 'value' }, value),
          h('div', { class: 'label' }, label))));
      }

      form.addEventListener('submit', async (event) => {
        event.preventDefault();
        status.textContent = '';
        UG.clear(output);
        showMetrics([]);
        if (!pastedKey) { status.textContent = 'Paste an API key first.'; return; }
        const request = Object.assign(body(), { stream_options: { include_usage: true } });
        controller = new AbortController();
        send.disabled = true;
        const started = performance.now();
        let first = null;
        let usage = null;
        let requestId = '';
        try {
          const response = await fetch('/v1/chat/completions', {
            method: 'POST', signal: controller.signal, credentials: 'omit', cache: 'no-store',
            headers: { 'content-type': 'application/json', authorization: 'Bearer ' + pastedKey },
            body: JSON.stringify(request),
          });
          requestId = response.headers.get('x-request-id') || '';
          if (!response.ok) throw await UG.errorOf(response);
          await readStream(response, (event) => {
            if (event.error) throw new UG.ApiError(500, event.error);
            if (event.usage) usage = event.usage;
            const delta = event.choices && event.choices[0] && event.choices[0].delta;
            if (delta && delta.content) {
              if (first === null) first = performance.now();
              output.append(delta.content);
            }
          });
          const ended = performance.now();
          const tokens = usage ? usage.completion_tokens : null;
          const decodeS = first === null ? 0 : (ended - first) / 1000;
          showMetrics([
            ['TTFT', first === null ? '—' : ((first - started) / 1000).toFixed(3) + ' s', 'ttft'],
            ['Tokens/s', tokens && decodeS > 0 ? (Math.max(tokens - 1, 0) / decodeS).toFixed(1) : '—', 'tps'],
            ['Completion tokens', tokens === null ? '—' : String(tokens), 'tokens'],
            ['Request id', requestId || '—', 'request_id'],
          ]);
        } catch (error) {
          if (error.name === 'AbortError') status.textContent = 'Stopped.';
          else status.textContent = (error.status ? error.status + ' ' + error.code + ': ' : '') + error.message;
          if (requestId) showMetrics([['Request id', requestId, 'request_id']]);
        } finally {
          send.disabled = false;
          controller = null;
        }
      });

      UG.api('GET', '/admin/models').then((result) => {
        for (const m of result.data) {
          if (m.id.endsWith('*')) continue;
          model.appendChild(h('option', { value: m.id }, m.id));
          for (const alias of m.aliases) model.appendChild(h('option', { value: alias }, alias + ' → ' + m.id));
        }
        drawCode();
      }).catch((e) => { status.textContent = e.message; });
      drawCode();
    },
  };
})();
