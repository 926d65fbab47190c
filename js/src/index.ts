/**
 * nbdist in JupyterLab and Notebook 7: a distributed cell's output and dashboard for a page that was
 * not open when the cell ran (the tab was closed, another browser). The kernel keeps what each
 * distributed cell shows in its world's directory; nbdist's server extension serves it at
 * nbdist/api/kernels/<id>/cells. This plugin asks when a notebook opens and every second while
 * one of its cells runs, and fills the cells this page did not run itself.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { ServerConnection } from '@jupyterlab/services';

import { WorldPanel } from './panel';

interface IShownCell {
  id: string;
  count: number | null;
  code: string;
  running: boolean;
  version: number;
  outputs: any[];
}

const RUNNING_MS = 1000;
const IDLE_MS = 5000;

class Follower {
  private seen = new Map<string, number>();
  private ranHere = new Set<string>(); // ids of the cells this page itself ran
  private filled = new Set<string>(); // ids of the cells this page filled from a transcript
  private timer: number | undefined;
  private stopped = false;

  constructor(private panel: NotebookPanel, private settings: ServerConnection.ISettings) {
    panel.disposed.connect(() => this.stop());
    panel.sessionContext.kernelChanged.connect(() => this.schedule(0));
    NotebookActions.executionScheduled.connect(this.onScheduled, this);
  }

  private onScheduled(_: unknown, args: { notebook: unknown; cell: { model: { id: string } } }): void {
    if (args.notebook === this.panel.content) {
      this.ranHere.add(args.cell.model.id);
    }
  }

  start(): void {
    void this.panel.sessionContext.ready.then(() => this.schedule(0));
  }

  stop(): void {
    this.stopped = true;
    window.clearTimeout(this.timer);
    NotebookActions.executionScheduled.disconnect(this.onScheduled, this);
  }

  private schedule(ms: number): void {
    window.clearTimeout(this.timer);
    if (!this.stopped) {
      this.timer = window.setTimeout(() => void this.look(), ms);
    }
  }

  private async look(): Promise<void> {
    let running = false;
    try {
      running = await this.fill();
    } catch (reason) {
      console.debug('nbdist: no transcript this time', reason);
    }
    this.schedule(running ? RUNNING_MS : IDLE_MS);
  }

  /** Fill the cells this page did not run; true while one of them still runs. */
  private async fill(): Promise<boolean> {
    const kernel = this.panel.sessionContext.session?.kernel;
    const model = this.panel.content.model;
    if (!kernel || !model) {
      return false;
    }
    // The distributed cells this page shows nothing for, or filled from a transcript: the server looks for them in
    // other kernels' worlds too (a notebook renamed or moved while its cell ran is opened with a new kernel).
    const empty = Array.from(model.cells)
      .filter(c => c.type === 'code' && !this.ranHere.has(c.id))
      .filter(c => (c as any).outputs.length === 0 || this.filled.has(c.id))
      .filter(c => c.sharedModel.getSource().includes('%dist'))
      .map(c => c.id)
      .slice(0, 200);
    const query = empty.length ? `?ids=${encodeURIComponent(empty.join(','))}` : '';
    const url = URLExt.join(this.settings.baseUrl, 'nbdist/api/kernels', kernel.id, 'cells') + query;
    const response = await ServerConnection.makeRequest(url, {}, this.settings);
    if (!response.ok) {
      return false;
    }
    const cells: IShownCell[] = (await response.json()).cells;
    let running = false;
    for (const shown of cells) {
      running = running || shown.running;
      const run = `${shown.id}:${shown.count}`;
      if (this.seen.get(run) === shown.version) {
        continue;
      }
      const all = Array.from(model.cells);
      // by id; a notebook saved without ids gets new ones in each page: then by its source
      const cell =
        all.find(c => c.id === shown.id) ||
        all.filter(c => c.type === 'code' && c.sharedModel.getSource() === shown.code).pop();
      if (!cell || cell.type !== 'code') {
        continue;
      }
      const code = cell as any;
      // A cell this page runs shows its own output; so does one it ran and saw to its end: a run of
      // a cell this page ran, with the count its kernel replied, that it never filled. The transcript
      // may still say "running" for it (fetched before the end). A cell this page ran whose reply has not
      // come (no count yet) is this page's own run too: under Run All it can wait in the page's queue, not
      // "running", while the kernel already runs it (a --noblock cell before it returned at once). A count
      // alone does not tell: a page opened later may load a notebook saved while another page showed a
      // transcript.
      if (code.executionState === 'running') {
        continue;
      }
      const mine = code.executionCount === shown.count || code.executionCount === null;
      if (!this.seen.has(run) && this.ranHere.has(cell.id) && mine) {
        continue;
      }
      code.outputs.clear();
      for (const output of shown.outputs) {
        code.outputs.add(output);
      }
      code.executionCount = shown.count;
      this.seen.set(run, shown.version);
      this.filled.add(cell.id);
    }
    return running;
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'nbdist:transcripts',
  description: "Shows a distributed cell's output and dashboard in a page opened after the cell began.",
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker) => {
    const settings = app.serviceManager.serverSettings;
    tracker.widgetAdded.connect((_, panel) => new Follower(panel, settings).start());
  }
};

const panel: JupyterFrontEndPlugin<void> = {
  id: 'nbdist:world-panel',
  description: 'A side panel with the ranks of each of your worlds, and actions that work while a cell runs.',
  autoStart: true,
  requires: [IRenderMimeRegistry],
  activate: (app: JupyterFrontEnd, rendermime: IRenderMimeRegistry) => {
    app.shell.add(new WorldPanel(app, rendermime), 'left', { rank: 950 });
  }
};

export default [plugin, panel];
